"""A teacher behind inference servers: vLLM's OpenAI-compatible API or SGLang's native one, at
one address or several replicas (:mod:`opd.teachers.replicas`).

Sequences go out in batches with bounded concurrency. A connection error, timeout, 5xx or
malformed answer sends the request to the next live replica (the one that failed leaves the
rotation); when none answers, it is retried with exponential backoff and jitter; a busy server's
429/503 is retried after the ``Retry-After`` it asks for. A 4xx answer (the request's fault, the
same on every replica), or the last failed retry, raises :class:`RemoteTeacherError` naming the
server and what it said. Every answer is checked (:mod:`opd.teachers.answers`) before a step
may use it.
"""

from __future__ import annotations

import json
import os
import random
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

from opd.data.sequences import Completion
from opd.errors import RemoteTeacherError
from opd.sampling.base import neutral_sampling_body
from opd.secrets import redact
from opd.teachers.answers import (
    BadAnswer,
    Scored,
    parse_prompt_choices,
    parse_sampled,
    parse_sglang,
    refusal_hint,
    server_message,
)
from opd.teachers.base import TeacherInput, TeacherRequest, TeacherScores
from opd.teachers.config import TeacherConfig
from opd.teachers.replicas import DISAGREEMENT_NATS, Replica, ReplicaPool, probe_gap

BUSY_STATUSES = (429, 503)
"""A server that is up but full: asked again after its ``Retry-After``, not taken out of
rotation."""
MOST_RETRY_AFTER_S = 30.0
"""The longest ``Retry-After`` obeyed (a server asking more is asked again after this)."""


class _Fault(Exception):
    """A replica that did not answer usably; ``wait_s`` set when it asked to be asked later."""

    def __init__(self, message: str, wait_s: float | None = None, other_weights: bool = False):
        super().__init__(message)
        self.wait_s = wait_s
        self.other_weights = other_weights


class RemoteTeacher:
    """Scores token ids through ``POST {base_url}/completions`` (openai) or ``/generate``
    (sglang)."""

    @classmethod
    def from_config(cls, teacher: TeacherConfig) -> RemoteTeacher:
        """The remote teacher a ``teacher`` section (or a mixture's member) describes."""
        return cls(
            backend=teacher.backend,
            base_url=teacher.base_url,
            model=teacher.model,
            api_key_env=teacher.api_key_env,
            timeout_s=teacher.timeout_s,
            max_retries=teacher.max_retries,
            max_concurrency=teacher.max_concurrency,
            request_batch_size=teacher.request_batch_size,
            replica_rest_s=teacher.replica_rest_s,
        )

    def __init__(
        self,
        *,
        backend: str,
        base_url: str | list[str],
        model: str,
        api_key_env: str | None = None,
        timeout_s: float = 60.0,
        max_retries: int = 4,
        max_concurrency: int = 4,
        request_batch_size: int = 8,
        backoff_s: float = 0.5,
        replica_rest_s: float = 30.0,
    ):
        self.backend = backend
        self.pool = ReplicaPool(
            [base_url] if isinstance(base_url, str) else list(base_url), replica_rest_s
        )
        self.model = model
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.max_concurrency = max_concurrency
        self.request_batch_size = request_batch_size if backend == "openai" else 1
        self.backoff_s = backoff_s
        self.probe: tuple[list[int], torch.Tensor] | None = None
        """The start's probe sequence and the answer it got (set by ``check_replicas``): a
        replica back from a failure must answer it the same before it is used again."""
        self._headers = {"Content-Type": "application/json"}
        if api_key_env:
            key = os.environ.get(api_key_env)
            if not key:
                raise RemoteTeacherError(
                    f"teacher.api_key_env: the environment variable {api_key_env} is not set or "
                    "empty"
                )
            self._headers["Authorization"] = f"Bearer {key}"

    def url_of(self, replica: Replica) -> str:
        """The URL a replica's requests go to."""
        route = "/completions" if self.backend == "openai" else "/generate"
        return replica.base_url + route

    def endpoint_of(self, replica: Replica) -> str:
        """A replica's URL as messages name it: credentials in it masked."""
        return redact(self.url_of(replica))

    @property
    def endpoint(self) -> str:
        """The first replica's URL as messages name it."""
        return self.endpoint_of(self.pool.replicas[0])

    def _ask(self, replica: Replica, data: bytes, parse: Callable[[object], object]):
        """One request to one replica, its answer parsed; :class:`_Fault` when the replica is at
        fault (unreachable, slow, 5xx, busy, malformed), RemoteTeacherError when the request is."""
        request = urllib.request.Request(
            self.url_of(replica), data=data, headers=self._headers, method="POST"
        )
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                body = response.read()
        except urllib.error.HTTPError as error:
            detail = server_message(error.read().decode(errors="replace"))
            if error.code in BUSY_STATUSES:
                asked = (error.headers.get("Retry-After") or "").strip()
                wait = min(float(asked), MOST_RETRY_AFTER_S) if asked.isdigit() else None
                raise _Fault(f"HTTP {error.code}: {detail}", wait) from None
            if error.code < 500:
                raise RemoteTeacherError(
                    f"teacher server {self.endpoint_of(replica)} answered HTTP {error.code}: "
                    f"{detail}{refusal_hint(error.code, detail)}"
                ) from None
            raise _Fault(f"HTTP {error.code}: {detail}") from None
        except (urllib.error.URLError, TimeoutError, ConnectionError) as error:
            reason = getattr(error, "reason", error)
            if isinstance(reason, TimeoutError | socket.timeout):
                raise _Fault(f"timed out after {self.timeout_s}s") from None
            raise _Fault(str(reason)) from None
        try:
            answer = json.loads(body)
        except json.JSONDecodeError:
            raise BadAnswer(f"answered with malformed JSON: {body[:200]!r}") from None
        return parse(answer)

    def _post(self, payload: dict, parse: Callable[[object], object], only: Replica | None = None):
        """``payload`` answered and parsed by a live replica (``only``: by that one), round the
        replicas first, then with backoff, ``max_retries`` rounds after the first."""
        data = json.dumps(payload).encode()
        failures: dict[str, str] = {}
        for attempt in range(self.max_retries + 1):
            tried: set[str] = set()
            waits = []
            while choice := self._next(only, tried):
                replica, probe_first = choice
                tried.add(replica.base_url)
                try:
                    if probe_first:
                        self._probe(replica)
                    answer = self._ask(replica, data, parse)
                except _Fault as fault:
                    failures[replica.base_url] = str(fault)
                    if fault.wait_s is None:
                        self.pool.take_out(replica, str(fault), say=fault.other_weights)
                    waits.append(fault.wait_s)
                    continue
                except BadAnswer as bad:
                    message = f"teacher server {self.endpoint_of(replica)}: {bad}"
                    if not self.pool.several or only:
                        raise RemoteTeacherError(message) from None
                    failures[replica.base_url] = str(bad)
                    self.pool.take_out(replica, str(bad))
                    continue
                if not replica.live:
                    self.pool.take_back(replica)
                return answer
            if attempt < self.max_retries:
                asked = [w for w in waits if w is not None]
                pause = max(asked) if asked and len(asked) == len(waits) else None
                time.sleep(
                    pause
                    if pause is not None
                    else self.backoff_s * 2**attempt + random.uniform(0, self.backoff_s)
                )
        if len(failures) == 1 or only:
            ((where, last),) = list(failures.items())[-1:]
            url = self.url_of(Replica(where))
            raise RemoteTeacherError(
                f"teacher server {redact(url)} failed after {self.max_retries + 1} attempts: {last}"
            )
        said = "; ".join(f"{redact(self.url_of(Replica(u)))}: {m}" for u, m in failures.items())
        raise RemoteTeacherError(
            f"every teacher replica failed, {self.max_retries + 1} attempts each ({said})"
        )

    def _next(self, only: Replica | None, tried: set[str]) -> tuple[Replica, bool] | None:
        """The replica to ask next and whether to probe it first (None: this round is over)."""
        if only is not None:
            return None if tried else (only, False)
        return self.pool.choose(tried)

    def _probe(self, replica: Replica) -> None:
        """A replica back from its rest answers the start's probe as the run started, or stays
        out."""
        if self.probe is None:
            return
        ids, reference = self.probe
        data = json.dumps(self._score_payload([ids], 0)).encode()
        answer = self._ask(replica, data, self._parse_scores([ids], 0))[0][0]
        mean, most = probe_gap(answer, reference)
        if mean > DISAGREEMENT_NATS:
            raise _Fault(
                f"it answers the probe {mean:.3f} nats a token apart from the run's start (at most "
                f"{most:.3f}): other weights",
                other_weights=True,
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
        for row, (length, (logprobs, top_ids, top_values)) in enumerate(
            zip(lengths, flat, strict=True)
        ):
            scored = inputs.score_mask_BT[row, :length].bool().clone()
            scored[0] = False
            scores.logprobs_BT[row, :length] = torch.where(
                scored, logprobs, torch.zeros_like(logprobs)
            )
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
        request a row with its own seed, so a row draws the same whatever rows share its batch
        (and whichever replica answers it).

        Every sampling setting is sent, so a server's own generation defaults (a checkpoint's
        top-p, say) do not apply: the teacher samples ``softmax(logits / temperature)``.
        """
        if self.backend != "openai":
            raise RemoteTeacherError(
                f"teacher server {self.endpoint}: backend '{self.backend}' only scores; a teacher "
                "that writes completions is reached through the OpenAI completions route "
                "(backend: openai)"
            )
        sampling = neutral_sampling_body(max_tokens, temperature, stop_token_ids, stop_strings)
        body = {"model": self.model} | sampling

        def one(row: int) -> Completion:
            payload = body | {"prompt": prompts[row], "seed": seeds[row]}
            return Completion(
                *self._post(payload, lambda answer: parse_sampled(prompts[row], answer))
            )

        in_flight = self.max_concurrency * self.request_batch_size  # as many rows as scoring sends
        with ThreadPoolExecutor(max_workers=max(1, min(in_flight, len(prompts)))) as pool:
            return list(pool.map(one, range(len(prompts))))

    def score_sequence(self, ids: list[int], replica: Replica | None = None) -> torch.Tensor:
        """One sequence's log-prob of each token, alone in one request (position 0's is not read),
        from ``replica`` when given."""
        return self._post(self._score_payload([ids], 0), self._parse_scores([ids], 0), replica)[0][
            0
        ]

    def _score_payload(self, batch: list[list[int]], topk: int) -> dict:
        if self.backend == "openai":
            return {
                "model": self.model,
                "prompt": batch,
                "max_tokens": 1,
                "temperature": 1.0,
                "prompt_logprobs": topk,
            }
        (ids,) = batch
        return {
            "input_ids": ids,
            "sampling_params": {"max_new_tokens": 0, "temperature": 1.0},
            "return_logprob": True,
            "logprob_start_len": 0,
            "top_logprobs_num": topk,
        }

    def _parse_scores(self, batch: list[list[int]], topk: int) -> Callable[[object], list[Scored]]:
        if self.backend == "openai":
            return lambda answer: parse_prompt_choices(batch, answer, topk)

        def sglang(answer) -> list[Scored]:
            meta = answer.get("meta_info") if isinstance(answer, dict) else None
            if not isinstance(meta, dict):
                raise BadAnswer(
                    f"sent no 'meta_info' object (for a sequence of {len(batch[0])} tokens)"
                )
            return [parse_sglang(batch[0], meta, topk)]

        return sglang

    def _score_batch(self, batch: list[list[int]], topk: int) -> list[Scored]:
        return self._post(self._score_payload(batch, topk), self._parse_scores(batch, topk))
