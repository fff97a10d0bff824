"""A teacher behind an inference server: vLLM's OpenAI-compatible API or SGLang's native one.

Sequences go out in batches with bounded concurrency; connection errors, timeouts and 5xx
answers are retried with exponential backoff and jitter; a 4xx answer, or the last failed
retry, raises :class:`RemoteTeacherError` naming the server and what it said. Every answer
is checked (one log-prob per token, the same ids, finite values, k top entries) before a
step may use it.
"""

from __future__ import annotations

import json
import math
import os
import random
import socket
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import torch

from opd.data.sequences import Completion
from opd.errors import RemoteTeacherError
from opd.sampling.base import neutral_sampling_body
from opd.secrets import redact
from opd.teachers.base import TeacherInput, TeacherRequest, TeacherScores


def server_message(body: str) -> str:
    """The message of a vLLM / SGLang / opd serve error body (``{"error": {"message"}}`` or
    ``{"message"}``), or the body itself, cut to 500 characters."""
    try:
        answer = json.loads(body)
    except json.JSONDecodeError:
        return body[:500]
    inner = answer.get("error", answer) if isinstance(answer, dict) else None
    message = inner.get("message") if isinstance(inner, dict) else None
    return str(message)[:500] if message else body[:500]


def refusal_hint(status: int, message: str) -> str:
    """What to change in opd or on the server for the refusals users meet most."""
    lowered = message.lower()
    if status == 404 and "model" in lowered:
        return "; set teacher.model to the name the server serves (GET /v1/models lists it)"
    if "max allowed" in lowered or "max_logprobs" in lowered:
        return (
            "; start the server with a larger --max-logprobs, or ask for fewer (training.objective.topk; "
            "teacher.character_topk for a cross_tokenizer teacher)"
        )
    if "out of vocabulary" in lowered:
        return (
            "; the server's model has fewer ids than the student's tokenizer: serve a teacher that "
            "shares it, or set cross_tokenizer: true with teacher.tokenizer"
        )
    if "maximum context length" in lowered or "max_model_len" in lowered or "too long" in lowered:
        return "; start the server with a larger --max-model-len, or lower training.max_tokens"
    return ""


LOGPROB_ROUNDING = 1e-4
"""How far above 0 a server's log-prob may be (float rounding of a near-certain token)."""
FLOAT32_LOWEST = -3.4028234663852886e38
"""Below it a log-prob cannot be held in the float32 tensors the scores go into: refused as infinite."""


MAX_TOKEN_ID = 2**31
"""No vocabulary is larger; a bigger id in an answer is garbage (and would overflow a tensor)."""


class RemoteTeacher:
    """Scores token ids through ``POST {base_url}/completions`` (openai) or ``/generate`` (sglang)."""

    def __init__(
        self,
        *,
        backend: str,
        base_url: str,
        model: str,
        api_key_env: str | None = None,
        timeout_s: float = 60.0,
        max_retries: int = 4,
        max_concurrency: int = 4,
        request_batch_size: int = 8,
        backoff_s: float = 0.5,
    ):
        self.backend = backend
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.max_concurrency = max_concurrency
        self.request_batch_size = request_batch_size if backend == "openai" else 1
        self.backoff_s = backoff_s
        self._headers = {"Content-Type": "application/json"}
        if api_key_env:
            key = os.environ.get(api_key_env)
            if not key:
                raise RemoteTeacherError(
                    f"teacher.api_key_env: the environment variable {api_key_env} is not set or empty"
                )
            self._headers["Authorization"] = f"Bearer {key}"

    @property
    def url(self) -> str:
        """The URL requests go to."""
        return f"{self.base_url}/completions" if self.backend == "openai" else f"{self.base_url}/generate"

    @property
    def endpoint(self) -> str:
        """The URL as messages name it: credentials in it masked."""
        return redact(self.url)

    def _post(self, payload: dict) -> dict:
        data = json.dumps(payload).encode()
        last_error = "no attempt made"
        for attempt in range(self.max_retries + 1):
            if attempt:
                time.sleep(self.backoff_s * 2 ** (attempt - 1) + random.uniform(0, self.backoff_s))
            request = urllib.request.Request(self.url, data=data, headers=self._headers, method="POST")
            try:
                with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                    body = response.read()
            except urllib.error.HTTPError as error:
                detail = server_message(error.read().decode(errors="replace"))
                if error.code < 500:
                    raise RemoteTeacherError(
                        f"teacher server {self.endpoint} answered HTTP {error.code}: {detail}"
                        f"{refusal_hint(error.code, detail)}"
                    ) from None
                last_error = f"HTTP {error.code}: {detail}"
                continue
            except (urllib.error.URLError, TimeoutError, ConnectionError) as error:
                reason = getattr(error, "reason", error)
                last_error = (
                    f"timed out after {self.timeout_s}s"
                    if isinstance(reason, TimeoutError | socket.timeout)
                    else str(reason)
                )
                continue
            try:
                return json.loads(body)
            except json.JSONDecodeError:
                raise RemoteTeacherError(
                    f"teacher server {self.endpoint} answered with malformed JSON: {body[:200]!r}"
                ) from None
        raise RemoteTeacherError(
            f"teacher server {self.endpoint} failed after {self.max_retries + 1} attempts: {last_error}"
        )

    def score(self, inputs: TeacherInput, request: TeacherRequest) -> TeacherScores:
        """Log-probs (and top-k) of every sequence, sent as token-id lists (the servers' JSON).

        The servers answer at temperature 1; configs that would need another are refused upstream.
        """
        if request.hidden:
            raise RemoteTeacherError(
                "a remote teacher sends log-probs, not hidden states: use a local teacher for jsd"
            )
        lengths = inputs.attention_mask_BT.sum(-1).tolist()
        sequences = [row[:n].tolist() for row, n in zip(inputs.input_ids_BT, lengths, strict=True)]
        batches = [
            sequences[i : i + self.request_batch_size]
            for i in range(0, len(sequences), self.request_batch_size)
        ]
        with ThreadPoolExecutor(max_workers=self.max_concurrency) as pool:
            answered = list(pool.map(lambda batch: self._score_batch(batch, request.topk), batches))
        flat = [scores for batch_result in answered for scores in batch_result]
        scores = TeacherScores.zeros(*inputs.input_ids_BT.shape, request)
        for row, (length, (logprobs, top_ids, top_values)) in enumerate(zip(lengths, flat, strict=True)):
            scored = inputs.score_mask_BT[row, :length].bool().clone()
            scored[0] = False
            scores.logprobs_BT[row, :length] = torch.where(scored, logprobs, torch.zeros_like(logprobs))
            if request.topk:
                scores.topk_ids_BTK[row, :length][scored] = top_ids[scored]
                scores.topk_logprobs_BTK[row, :length][scored] = top_values[scored]
        return scores

    def sample(
        self,
        prompts: list[list[int]],
        *,
        temperature: float,
        max_tokens: int,
        seeds: list[int],
        stop_token_ids: list[int],
        stop_strings: list[str],
    ) -> list[Completion]:
        """One completion per prompt written by the served model (OpenAI completions route), a
        request a row with its own seed, so a row draws the same whatever rows share its batch.

        Every sampling setting is sent, so a server's own generation defaults (a checkpoint's
        top-p, say) do not apply: the teacher samples ``softmax(logits / temperature)``.
        """
        if self.backend != "openai":
            raise RemoteTeacherError(
                f"teacher server {self.endpoint}: backend '{self.backend}' only scores; a teacher that "
                "writes completions is reached through the OpenAI completions route (backend: openai)"
            )
        sampling = neutral_sampling_body(max_tokens, temperature, stop_token_ids, stop_strings)
        body = {"model": self.model} | sampling

        def one(row: int) -> Completion:
            answer = self._post(body | {"prompt": prompts[row], "seed": seeds[row]})
            choices = answer.get("choices") if isinstance(answer, dict) else None
            choice = choices[0] if isinstance(choices, list) and len(choices) == 1 else None
            if not isinstance(choice, dict):
                raise self._fail(prompts[row], "sent no single choice for a sampled completion")
            token_ids = choice.get("token_ids")
            if not isinstance(token_ids, list) or not all(self._is_id(t) for t in token_ids):
                raise self._fail(
                    prompts[row],
                    "sent no 'token_ids' with its completion (return_token_ids: vLLM 0.10 or later, "
                    "or opd serve)",
                )
            logprobs = (choice.get("logprobs") or {}).get("token_logprobs")
            if not isinstance(logprobs, list) or len(logprobs) != len(token_ids):
                count = len(logprobs) if isinstance(logprobs, list) else "no"
                raise self._fail(prompts[row], f"sent {count} log-probs for {len(token_ids)} sampled tokens")
            values = [self._logprob(value, prompts[row], position) for position, value in enumerate(logprobs)]
            return Completion(list(token_ids), values, finished=choice.get("finish_reason") == "stop")

        in_flight = self.max_concurrency * self.request_batch_size  # as many rows as scoring sends
        with ThreadPoolExecutor(max_workers=max(1, min(in_flight, len(prompts)))) as pool:
            return list(pool.map(one, range(len(prompts))))

    def score_sequence(self, ids: list[int]) -> torch.Tensor:
        """One sequence's log-prob of each token, alone in one request (position 0's is not read)."""
        return self._score_batch([ids], 0)[0][0]

    def _score_batch(
        self, batch: list[list[int]], topk: int
    ) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        if self.backend == "openai":
            payload = {
                "model": self.model,
                "prompt": batch,
                "max_tokens": 1,
                "temperature": 1.0,
                "prompt_logprobs": topk,
            }
            answer = self._post(payload)
            choices = answer.get("choices") if isinstance(answer, dict) else None
            if not isinstance(choices, list) or len(choices) != len(batch):
                count = len(choices) if isinstance(choices, list) else "no"
                raise RemoteTeacherError(
                    f"teacher server {self.endpoint} sent {count} choices for {len(batch)} prompts"
                )
            indices = [c.get("index") if isinstance(c, dict) else None for c in choices]
            if sorted(i for i in indices if self._is_id(i)) != list(range(len(batch))):
                raise RemoteTeacherError(
                    f"teacher server {self.endpoint} sent choices indexed {indices[:8]} for {len(batch)} "
                    "prompts (each index 0..n-1 once)"
                )
            choices = sorted(choices, key=lambda c: c["index"])
            return [
                self._parse_openai(ids, choice.get("prompt_logprobs"), topk)
                for ids, choice in zip(batch, choices, strict=True)
            ]
        (ids,) = batch
        payload = {
            "input_ids": ids,
            "sampling_params": {"max_new_tokens": 0, "temperature": 1.0},
            "return_logprob": True,
            "logprob_start_len": 0,
            "top_logprobs_num": topk,
        }
        answer = self._post(payload)
        meta = answer.get("meta_info") if isinstance(answer, dict) else None
        if not isinstance(meta, dict):
            raise self._fail(ids, "sent no 'meta_info' object")
        return [self._parse_sglang(ids, meta, topk)]

    def _fail(self, ids: list[int], what: str) -> RemoteTeacherError:
        return RemoteTeacherError(
            f"teacher server {self.endpoint}: {what} (for a sequence of {len(ids)} tokens)"
        )

    def _parse_openai(self, ids: list[int], entries, topk: int):
        if not isinstance(entries, list) or len(entries) != len(ids):
            count = len(entries) if isinstance(entries, list) else "no"
            raise self._fail(ids, f"sent {count} prompt log-probs for {len(ids)} tokens")
        logprobs = torch.zeros(len(ids))
        top_ids = torch.zeros(len(ids), max(topk, 1), dtype=torch.long)
        top_values = torch.full((len(ids), max(topk, 1)), -math.inf)
        for position in range(1, len(ids)):
            entry = entries[position]
            token = str(ids[position])
            if not isinstance(entry, dict) or not isinstance(entry.get(token), dict):
                raise self._fail(ids, f"no log-prob for token id {ids[position]} at position {position}")
            logprobs[position] = self._logprob(entry[token].get("logprob"), ids, position)
            if topk:
                ranked = sorted(
                    (self._ranked(key, value, ids, position) for key, value in entry.items()),
                    key=lambda r: r[0],
                )
                ranked = [r for r in ranked if r[0] <= topk]
                if len(ranked) < topk:
                    raise self._fail(
                        ids,
                        f"sent {len(ranked)} top log-probs at position {position}, fewer than the "
                        f"requested {topk} (is the server's --max-logprobs below {topk}?)",
                    )
                top_ids[position] = torch.tensor([r[1] for r in ranked[:topk]])
                top_values[position] = torch.tensor(
                    [self._logprob(r[2], ids, position) for r in ranked[:topk]]
                )
        return logprobs, top_ids, top_values

    def _parse_sglang(self, ids: list[int], meta: dict, topk: int):
        token_logprobs = meta.get("input_token_logprobs")
        if not isinstance(token_logprobs, list) or len(token_logprobs) != len(ids):
            count = len(token_logprobs) if isinstance(token_logprobs, list) else "no"
            raise self._fail(ids, f"sent {count} input token log-probs for {len(ids)} tokens")
        top = meta.get("input_top_logprobs") or [None] * len(ids)
        if not isinstance(top, list) or len(top) != len(ids):
            raise self._fail(ids, "sent 'input_top_logprobs' that is not one list per token")
        logprobs = torch.zeros(len(ids))
        top_ids = torch.zeros(len(ids), max(topk, 1), dtype=torch.long)
        top_values = torch.full((len(ids), max(topk, 1)), -math.inf)
        for position in range(1, len(ids)):
            value, token = self._pair(token_logprobs[position], ids, position)
            if token != ids[position]:
                raise self._fail(
                    ids, f"answered for token id {token} at position {position}, not {ids[position]}"
                )
            logprobs[position] = self._logprob(value, ids, position)
            if topk:
                entries = top[position] or []
                if not isinstance(entries, list) or len(entries) < topk:
                    count = len(entries) if isinstance(entries, list) else "no"
                    raise self._fail(
                        ids, f"sent {count} top log-probs at position {position}, fewer than {topk}"
                    )
                pairs = [self._pair(e, ids, position) for e in entries[:topk]]
                top_ids[position] = torch.tensor([token_id for _, token_id in pairs])
                top_values[position] = torch.tensor([self._logprob(v, ids, position) for v, _ in pairs])
        return logprobs, top_ids, top_values

    def _pair(self, entry, ids: list[int], position: int) -> tuple[object, int]:
        """SGLang's ``[logprob, token_id, text]`` at ``position``, its id checked."""
        if not isinstance(entry, list | tuple) or len(entry) < 2 or not self._is_id(entry[1]):
            raise self._fail(
                ids, f"sent {str(entry)[:80]} at position {position}, not [logprob, token_id, text]"
            )
        return entry[0], entry[1]

    def _ranked(self, key: str, value, ids: list[int], position: int) -> tuple[float, int, object]:
        """(rank, token id, log-prob) of one vLLM prompt-logprobs entry."""
        token_id = int(key) if isinstance(key, str) and key.isdigit() else None
        if token_id is None or not self._is_id(token_id) or not isinstance(value, dict):
            raise self._fail(ids, f"sent an entry {key!r}: {str(value)[:80]} at position {position}")
        rank = value.get("rank")
        if rank is None:
            rank = math.inf
        if (not isinstance(rank, int) or isinstance(rank, bool)) and rank != math.inf:
            raise self._fail(ids, f"sent rank {rank!r} at position {position}, not an integer")
        return rank, token_id, value.get("logprob")

    @staticmethod
    def _is_id(value) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < MAX_TOKEN_ID

    def _logprob(self, value, ids: list[int], position: int) -> float:
        """A finite log-probability; rounding above 0 (up to ``LOGPROB_ROUNDING``) is read as 0."""
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not math.isfinite(value)
            or value < FLOAT32_LOWEST
        ):
            raise self._fail(ids, f"log-prob {value!r} at position {position} is not a finite number")
        if value > LOGPROB_ROUNDING:
            raise self._fail(
                ids, f"log-prob {value!r} at position {position} is above 0 (not a log-probability)"
            )
        return min(float(value), 0.0)
