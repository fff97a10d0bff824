"""``opd serve``: a small teacher server speaking the parts of the vLLM and SGLang APIs opd uses.

For CPU development and tests; a real deployment points the same client at vLLM or SGLang.

- ``POST /v1/completions`` (vLLM OpenAI-compatible): ``prompt`` is a list of token ids or a
  list of such lists; ``prompt_logprobs: k`` returns, for every prompt position, the
  prompt token's log-prob and the top-k (``null`` at position 0); ``max_tokens`` 0 or 1,
  ``echo`` accepted. ``k`` above ``--max-logprobs`` is refused, as vLLM does. Without
  ``prompt_logprobs`` it samples (a teacher writing completions): ``max_tokens``,
  ``temperature`` (0: greedy), ``seed``, ``stop_token_ids``, ``stop``, ``ignore_eos``,
  ``logprobs: 0`` and ``return_token_ids`` as vLLM reads them, from ``softmax(logits /
  temperature)`` only (other sampling settings at their neutral values).
- ``POST /generate`` (SGLang): ``input_ids``, ``return_logprob``, ``logprob_start_len``,
  ``top_logprobs_num``; answers ``meta_info.input_token_logprobs``.
- ``GET /v1/models``, ``GET /health``.

Malformed requests get a 4xx JSON error and the server keeps serving; :class:`ServerLimits` caps
what one client may cost (body size, time to send it, connections at once).
"""

from __future__ import annotations

import json
import sys
import threading
import time
import traceback
import uuid
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch

from opd.data.sequences import Completion
from opd.logprobs import chunk_logits, head_weights
from opd.models import load_causal_lm, load_tokenizer
from opd.sampling.hf_generate import HFGenerateSampler
from opd.teachers.base import TeacherInput, TeacherRequest
from opd.teachers.local import LocalTeacher


class RequestError(ValueError):
    """A request refused: answered with ``status`` (400 unless said) and this message, as vLLM words it."""

    def __init__(self, message: str, status: int = 400, param: str | None = None):
        super().__init__(message)
        self.status = status
        self.param = param


def error_body(message: str, status: int, param: str | None = None) -> dict:
    """vLLM's error JSON: ``{"error": {"message", "type", "param", "code"}}``."""
    kind = {404: "NotFoundError"}.get(status, "BadRequestError")
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


@dataclass
class _SampleJob:
    """One request's rows to sample, and what they became."""

    settings: tuple
    prompts: list[list[int]]
    seeds: list[int]
    completions: list[Completion] | None = None


class ScoringModel:
    """Prompt log-probs and top-k of a causal LM, scored by the same code as a local teacher."""

    def __init__(self, model, tokenizer, name: str, max_logprobs: int = 20):
        self.tokenizer = tokenizer
        self.name = name
        self.max_logprobs = max_logprobs
        self.vocab_size = len(tokenizer)
        self.max_model_len = getattr(model.config, "max_position_embeddings", None)
        self.teacher = LocalTeacher(model, vocab_size=self.vocab_size, pad_id=tokenizer.pad_token_id or 0)
        self.lock = threading.Lock()
        self.pending: list[_SampleJob] = []
        """Sampling requests waiting for the model: the next to hold ``lock`` samples them all."""
        self.pending_lock = threading.Lock()

    def sample(
        self,
        prompts: list[list[int]],
        temperature: float,
        max_tokens: int,
        seeds: list[int] | None,
        stop_token_ids: list[int],
        stop_strings: list[str],
    ) -> list[Completion]:
        """One completion per prompt from ``softmax(logits / temperature)`` (greedy at 0), sampled
        by the code that samples a local teacher, each row from its seed (None: a fresh one).

        Requests with the same settings that wait while the model is busy are sampled together
        in one batch (a client sends a request a row, as vLLM's per-request seed asks); each row
        draws from its own seed, so its tokens do not depend on the rows it is batched with.
        """
        if seeds is None:
            seeds = torch.randint(0, 2**62, (len(prompts),)).tolist()
        job = _SampleJob(
            (temperature, max_tokens, tuple(stop_token_ids), tuple(stop_strings)), prompts, seeds
        )
        with self.pending_lock:
            self.pending.append(job)
        with self.lock:
            if job.completions is None:
                with self.pending_lock:
                    batch = [j for j in self.pending if j.settings == job.settings]
                    self.pending = [j for j in self.pending if j.settings != job.settings]
                sampler = HFGenerateSampler(
                    self.teacher.model,
                    self.tokenizer,
                    stop_token_ids=stop_token_ids,
                    stop_strings=stop_strings,
                )
                sampled = sampler.sample(
                    [p for j in batch for p in j.prompts],
                    temperature=temperature or 1.0,
                    max_tokens=max_tokens,
                    greedy=temperature == 0,
                    seed=[s for j in batch for s in j.seeds],
                )
                for j in batch:
                    j.completions, sampled = sampled[: len(j.prompts)], sampled[len(j.prompts) :]
        return job.completions

    def score(
        self, prompts: list[list[int]], k: int
    ) -> list[list[tuple[float, int, list[tuple[int, float]]] | None]]:
        """Per prompt, per position: None at 0, else (log p(token), its rank, [(id, log p)] top-k by rank).

        The rank is vLLM's: one more than the number of ids the model finds strictly more likely.
        """
        inputs = TeacherInput.from_sequences(prompts, [[True] * len(p) for p in prompts], self.teacher.pad_id)
        with self.lock:
            scores = self.teacher.score(inputs, TeacherRequest(topk=max(k, 1), hidden=True))
            weight, bias = head_weights(scores.head, self.vocab_size)
            per_prompt = []
            for row, prompt in enumerate(prompts):
                length = len(prompt)
                values = scores.logprobs_BT[row, 1:length].tolist()
                logits, _ = chunk_logits(
                    scores.hidden_BTD[row, 1:length], weight, bias, scores.head_transform
                )
                chosen = logits.gather(-1, torch.tensor(prompt[1:], device=logits.device)[:, None])
                ranks = ((logits > chosen).sum(-1) + 1).tolist()
                top_ids = scores.topk_ids_BTK[row, 1:length, :k].tolist()
                top_values = scores.topk_logprobs_BTK[row, 1:length, :k].tolist()
                positions: list = [None]
                for value, rank, ids_k, values_k in zip(values, ranks, top_ids, top_values, strict=True):
                    positions.append((value, rank, list(zip(ids_k, values_k, strict=True))))
                per_prompt.append(positions)
        return per_prompt


def _token_ids(value, field: str, scorer: ScoringModel) -> list[int]:
    if (
        not isinstance(value, list)
        or not value
        or not all(isinstance(t, int) and not isinstance(t, bool) for t in value)
    ):
        raise RequestError(f"'{field}' must be a non-empty list of token ids")
    bad = [t for t in value if not 0 <= t < scorer.vocab_size]
    if bad:
        raise RequestError(f"Token id {bad[0]} is out of vocabulary (the model has {scorer.vocab_size} ids)")
    if scorer.max_model_len and len(value) > scorer.max_model_len:
        raise RequestError(
            f"This model's maximum context length is {scorer.max_model_len} tokens. However, you requested "
            f"{len(value)} tokens in the prompt.",
            param=field,
        )
    return value


def _count(body: dict, field: str, default: int, most: int | None = None) -> int:
    """A non-negative integer field of the request (``default`` when absent or null)."""
    value = body.get(field)
    if value is None:
        return default
    if (
        not isinstance(value, int)
        or isinstance(value, bool)
        or value < 0
        or (most is not None and value > most)
    ):
        bound = f"[0, {most}]" if most is not None else ">= 0"
        raise RequestError(
            f"'{field}' must be an integer in {bound}, got {json.dumps(value)[:40]}", param=field
        )
    return value


def completions_response(scorer: ScoringModel, body: dict) -> dict:
    """The answer to ``POST /v1/completions``: prompts scored, or completions sampled."""
    if body.get("model") not in (None, scorer.name):
        raise RequestError(
            f"The model `{body.get('model')}` does not exist. Valid aliases: {scorer.name}.", 404, "model"
        )
    prompt = body.get("prompt")
    prompts = prompt if isinstance(prompt, list) and prompt and isinstance(prompt[0], list) else [prompt]
    prompts = [_token_ids(p, "prompt", scorer) for p in prompts]
    k = body.get("prompt_logprobs")
    if k is None:
        return sampled_response(scorer, body, prompts)
    if not isinstance(k, int) or isinstance(k, bool) or k < 0:
        raise RequestError("'prompt_logprobs' must be a non-negative integer")
    if k > scorer.max_logprobs:
        raise RequestError(
            f"Requested prompt logprobs of {k}, which is greater than max allowed: {scorer.max_logprobs} "
            f"(parameter=prompt_logprobs, value={k})",
            param="prompt_logprobs",
        )
    if body.get("max_tokens", 16) not in (0, 1):
        raise RequestError("'max_tokens' must be 0 or 1 here (this server does not generate)")
    choices = []
    decode = scorer.tokenizer.decode
    for index, (ids, positions) in enumerate(zip(prompts, scorer.score(prompts, k), strict=True)):
        entries: list = [None]
        for token, position in zip(ids[1:], positions[1:], strict=True):
            value, rank, top = position
            # vLLM lists the prompt token first, then the top-k by rank
            entry = {str(token): {"logprob": value, "rank": rank, "decoded_token": decode([token])}}
            for top_rank, (tid, lp) in enumerate(top, start=1):
                entry.setdefault(str(tid), {"logprob": lp, "rank": top_rank, "decoded_token": decode([tid])})
            entries.append(entry)
        choices.append(
            {
                "index": index,
                "text": "",
                "logprobs": None,
                "finish_reason": "length",
                "stop_reason": None,
                "token_ids": None,
                "prompt_logprobs": entries,
                "prompt_token_ids": ids if body.get("return_token_ids") else None,
                "routed_experts": None,
            }
        )
    return completion_body(scorer, choices, sum(len(p) for p in prompts), 0)


def completion_body(
    scorer: ScoringModel, choices: list[dict], prompt_tokens: int, sampled_tokens: int
) -> dict:
    """A ``/v1/completions`` answer around its choices, in vLLM's shape."""
    return {
        "id": f"cmpl-{uuid.uuid4().hex[:16]}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": scorer.name,
        "choices": choices,
        "service_tier": None,
        "system_fingerprint": "opd-serve",
        "usage": {
            "prompt_tokens": prompt_tokens,
            "total_tokens": prompt_tokens + sampled_tokens,
            "completion_tokens": sampled_tokens,
            "prompt_tokens_details": None,
            "completion_tokens_details": None,
        },
        "kv_transfer_params": None,
        "ec_transfer_params": None,
        "metrics": None,
    }


NEUTRAL_SAMPLING = {
    "top_p": (1, 1.0),
    "top_k": (0, -1),
    "min_p": (0, 0.0),
    "presence_penalty": (0, 0.0),
    "frequency_penalty": (0, 0.0),
    "repetition_penalty": (1, 1.0),
    "n": (1,),
    "best_of": (1,),
    "echo": (False,),
}
"""Sampling settings this server accepts only at these values (absent or null: the same)."""


def _sampling(body: dict, scorer: ScoringModel) -> tuple[float, int, int | None, list[int], list[str]]:
    """``(temperature, max_tokens, seed, stop ids, stop strings)`` of a sampling request, checked."""
    for field, neutral in NEUTRAL_SAMPLING.items():
        value = body.get(field)
        if value is not None and (
            isinstance(value, bool) != isinstance(neutral[0], bool) or value not in neutral
        ):
            raise RequestError(
                f"'{field}' must be {neutral[0]!r} here (this server samples softmax(logits / temperature) "
                f"only), got {json.dumps(value)[:40]}",
                param=field,
            )
    if body.get("logprobs") not in (None, 0) or body.get("allowed_token_ids") is not None:
        field = "logprobs" if body.get("logprobs") not in (None, 0) else "allowed_token_ids"
        raise RequestError(
            f"'{field}' is not served here: the sampled tokens' log-probs only (logprobs: 0)", param=field
        )
    temperature = body.get("temperature", 1.0)
    if (
        isinstance(temperature, bool)
        or not isinstance(temperature, int | float)
        or not 0 <= temperature < 1e6
    ):
        raise RequestError(
            f"'temperature' must be a number >= 0, got {json.dumps(temperature)[:40]}", param="temperature"
        )
    max_tokens = _count(body, "max_tokens", 16)
    if max_tokens < 1:
        raise RequestError("'max_tokens' must be at least 1 to sample (or set 'prompt_logprobs' to score)")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63):
        raise RequestError(
            f"'seed' must be an integer in [0, 2**63), got {json.dumps(seed)[:40]}", param="seed"
        )
    stops = body.get("stop_token_ids") or []
    if stops:
        stops = _token_ids(stops, "stop_token_ids", scorer)
    strings = body.get("stop") or []
    strings = [strings] if isinstance(strings, str) else strings
    if not isinstance(strings, list) or not all(isinstance(s, str) and s for s in strings):
        raise RequestError("'stop' must be a string or a list of non-empty strings", param="stop")
    eos = scorer.tokenizer.eos_token_id
    if not body.get("ignore_eos") and eos is not None and eos not in stops:
        stops = [*stops, eos]
    if not stops:
        raise RequestError("nothing ends a completion: give 'stop_token_ids', or leave 'ignore_eos' false")
    return float(temperature), max_tokens, seed, stops, strings


def sampled_response(scorer: ScoringModel, body: dict, prompts: list[list[int]]) -> dict:
    """The answer to a ``POST /v1/completions`` that samples: one choice per prompt, in vLLM's shape
    (``token_ids`` with ``return_token_ids``; the stop token kept in them)."""
    temperature, max_tokens, seed, stops, strings = _sampling(body, scorer)
    seeds = None if seed is None else [seed] * len(prompts)
    completions = scorer.sample(prompts, temperature, max_tokens, seeds, stops, strings)
    decode = scorer.tokenizer.decode
    choices = []
    for index, completion in enumerate(completions):
        ids = completion.token_ids
        shown = ids[:-1] if completion.finished and ids and ids[-1] in stops else ids
        logprobs = None
        if body.get("logprobs") is not None:
            tokens = [decode([token]) for token in ids]
            offsets = [sum(len(text) for text in tokens[:i]) for i in range(len(tokens))]
            logprobs = {
                "text_offset": offsets,
                "token_logprobs": completion.logprobs,
                "tokens": tokens,
                "top_logprobs": None,
            }
        choices.append(
            {
                "index": index,
                "text": decode(shown, skip_special_tokens=body.get("skip_special_tokens", True)),
                "logprobs": logprobs,
                "finish_reason": "stop" if completion.finished else "length",
                "stop_reason": None,
                "token_ids": ids if body.get("return_token_ids") else None,
                "prompt_logprobs": None,
                "prompt_token_ids": prompts[index] if body.get("return_token_ids") else None,
                "routed_experts": None,
            }
        )
    sampled = sum(len(c.token_ids) for c in completions)
    return completion_body(scorer, choices, sum(len(p) for p in prompts), sampled)


def generate_response(scorer: ScoringModel, body: dict) -> dict:
    """The answer to SGLang's ``POST /generate`` for one prompt."""
    ids = _token_ids(body.get("input_ids"), "input_ids", scorer)
    if body.get("return_logprob") is not True:
        raise RequestError("this server only scores prompts: set 'return_logprob': true")
    start = _count(body, "logprob_start_len", 0)
    k = _count(body, "top_logprobs_num", 0, scorer.max_logprobs)
    (positions,) = scorer.score([ids], k)
    decode = scorer.tokenizer.decode
    token_logprobs, top_logprobs = [], []
    for position, token in enumerate(ids):
        if position < start:
            continue
        if positions[position] is None:
            token_logprobs.append([None, token, None])
            top_logprobs.append(None)
            continue
        value, _, top = positions[position]
        token_logprobs.append([value, token, decode([token])])
        top_logprobs.append([[lp, tid, decode([tid])] for tid, lp in top])
    meta = {
        "input_token_logprobs": token_logprobs,
        "input_top_logprobs": top_logprobs,
        "prompt_tokens": len(ids),
    }
    return {"text": "", "meta_info": meta}


def models_response(scorer: ScoringModel) -> dict:
    """The answer to ``GET /v1/models``, in vLLM's shape."""
    created = int(time.time())
    permission = {
        "id": f"modelperm-{uuid.uuid4().hex[:16]}",
        "object": "model_permission",
        "created": created,
        "allow_create_engine": False,
        "allow_sampling": True,
        "allow_logprobs": True,
        "allow_search_indices": False,
        "allow_view": True,
        "allow_fine_tuning": False,
        "organization": "*",
        "group": None,
        "is_blocking": False,
    }
    model = {
        "id": scorer.name,
        "object": "model",
        "created": created,
        "owned_by": "opd",
        "root": scorer.name,
        "parent": None,
        "max_model_len": scorer.max_model_len,
        "permission": [permission],
    }
    return {"object": "list", "data": [model]}


@dataclass(frozen=True)
class ServerLimits:
    """What one client may cost the server: body size, time to send it, connections held at once."""

    max_request_bytes: int = 16 * 2**20
    """Larger bodies get 413 before they are read (8 sequences of 32k tokens take about 2 MiB)."""
    request_timeout_s: float = 60.0
    """A client that takes longer to send its request (or sits idle on a kept-alive connection) is dropped."""
    max_connections: int = 64
    """Connections served at once; more wait in the listen backlog (256) until one finishes."""


def make_handler(scorer: ScoringModel, limits: ServerLimits = ServerLimits()):
    """An HTTP handler class bound to ``scorer``."""

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        timeout = limits.request_timeout_s  # socket timeout: a silent client is dropped

        def log_message(self, format, *args):
            return

        def _send(self, status: int, payload: dict) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            if self.close_connection:
                self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(data)

        def _error(self, status: int, message: str, param: str | None = None) -> None:
            self._send(status, error_body(message, status, param))

        def do_GET(self):
            if self.path == "/health":
                self._send(200, {"status": "ok"})
            elif self.path == "/v1/models":
                self._send(200, models_response(scorer))
            else:
                self._error(404, f"no route {self.path}")

        def _read_body(self) -> bytes:
            """The request body, within the size limit and the time limit, or a RequestError."""
            declared = self.headers.get("Content-Length")
            if declared is None:
                self.close_connection = True
                raise RequestError("a Content-Length header is required", 411)
            if not declared.strip().isdigit():
                self.close_connection = True
                raise RequestError(f"Content-Length {declared[:40]!r} is not a byte count")
            length = int(declared)
            if length > limits.max_request_bytes:
                self.close_connection = True  # the body is left unread
                raise RequestError(
                    f"the request body is {length} bytes, over this server's limit of "
                    f"{limits.max_request_bytes} (--max-request-bytes)",
                    413,
                )
            deadline = time.monotonic() + limits.request_timeout_s
            chunks, remaining = [], length
            while remaining:
                chunk = self.rfile.read1(min(remaining, 2**16))
                if not chunk or time.monotonic() > deadline:
                    self.close_connection = True
                    raise RequestError(
                        f"the request body ended or stalled after {length - remaining} of {length} bytes", 408
                    )
                chunks.append(chunk)
                remaining -= len(chunk)
            return b"".join(chunks)

        def do_POST(self):
            routes = {"/v1/completions": completions_response, "/generate": generate_response}
            try:
                body = self._read_body()
                if self.path not in routes:
                    raise RequestError(f"no route {self.path}", 404)
                request = json.loads(body or b"null")
                if not isinstance(request, dict):
                    raise RequestError("the request body must be a JSON object")
                self._send(200, routes[self.path](scorer, request))
            except (json.JSONDecodeError, UnicodeDecodeError):
                self._error(400, "the request body is not valid JSON")
            except RecursionError:
                self._error(400, "the request body is nested too deeply")
            except RequestError as error:
                self._error(error.status, str(error), error.param)
            except (TimeoutError, ConnectionError):
                self.close_connection = True
            except Exception as error:  # a defect of the server, not of the request: say so, keep serving
                traceback.print_exc(file=sys.stderr)
                self.close_connection = True
                self._send(
                    500, {"error": {"message": f"internal server error: {error!r}"[:300], "code": 500}}
                )

    return Handler


class LimitedServer(ThreadingHTTPServer):
    """A thread per connection, at most ``max_connections`` of them; further ones wait their turn.

    At the cap the accept loop waits for a connection to finish before accepting the next, so
    waiting clients queue in the kernel's listen backlog (first come, first served, bounded by
    ``request_queue_size``) instead of being refused: a burst costs latency, not failed requests.
    """

    daemon_threads = True
    request_queue_size = 256  # the listen backlog: socketserver's 5 makes bursts wait a second per SYN retry

    def __init__(self, address, handler, limits: ServerLimits):
        self.slots = threading.BoundedSemaphore(limits.max_connections)
        super().__init__(address, handler)

    def process_request(self, request, client_address):
        self.slots.acquire()
        super().process_request(request, client_address)

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()

    def handle_error(self, request, client_address):
        """A client that hung up or timed out is routine; anything else is printed."""
        if not isinstance(sys.exc_info()[1], ConnectionError | TimeoutError):
            super().handle_error(request, client_address)


def serve(
    model_path: str,
    host: str = "127.0.0.1",
    port: int = 8000,
    *,
    name: str | None = None,
    max_logprobs: int = 20,
    dtype: str = "auto",
    device: str = "auto",
    limits: ServerLimits = ServerLimits(),
) -> None:
    """Load the model and answer requests until interrupted."""
    tokenizer = load_tokenizer(model_path, "model")
    model = load_causal_lm(model_path, "model", dtype=dtype, device=device)
    scorer = ScoringModel(model, tokenizer, name or model_path, max_logprobs)
    server = LimitedServer((host, port), make_handler(scorer, limits), limits)
    print(f"opd serve: {scorer.name} on http://{host}:{server.server_address[1]}/v1", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
