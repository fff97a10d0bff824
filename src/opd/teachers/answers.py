"""What a teacher server answers, read and checked: one log-prob per token, the same ids, finite
values, k top entries. A check that fails raises :class:`BadAnswer`, which the request loop turns
into an error naming the server (or, with several replicas, a reason to ask another). A refusal
is read too: the server's message, and what to change for the refusals users meet most."""

from __future__ import annotations

import json
import math

import torch

from opd.errors import RemoteTeacherError

LOGPROB_ROUNDING = 1e-4
"""How far above 0 a server's log-prob may be (float rounding of a near-certain token)."""
FLOAT32_LOWEST = -3.4028234663852886e38
"""Below it a log-prob cannot be held in the float32 tensors the scores go into: refused as
infinite."""
MAX_TOKEN_ID = 2**31
"""No vocabulary is larger; a bigger id in an answer is garbage (and would overflow a tensor)."""

Scored = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
"""A sequence's log-prob of each token, its top-k ids and their log-probs (position 0 unread)."""


class BadAnswer(RemoteTeacherError):
    """A server's answer that cannot be used; the message says what is wrong, not which server."""


def _fail(ids: list[int], what: str) -> BadAnswer:
    return BadAnswer(f"{what} (for a sequence of {len(ids)} tokens)")


def parse_openai(ids: list[int], entries, topk: int) -> Scored:
    """One sequence's log-probs and top-k from vLLM's ``prompt_logprobs`` (one entry a token)."""
    if not isinstance(entries, list) or len(entries) != len(ids):
        count = len(entries) if isinstance(entries, list) else "no"
        raise _fail(ids, f"sent {count} prompt log-probs for {len(ids)} tokens")
    logprobs = torch.zeros(len(ids))
    top_ids = torch.zeros(len(ids), max(topk, 1), dtype=torch.long)
    top_values = torch.full((len(ids), max(topk, 1)), -math.inf)
    for position in range(1, len(ids)):
        entry = entries[position]
        token = str(ids[position])
        if not isinstance(entry, dict) or not isinstance(entry.get(token), dict):
            raise _fail(ids, f"no log-prob for token id {ids[position]} at position {position}")
        logprobs[position] = read_logprob(entry[token].get("logprob"), ids, position)
        if topk:
            ranked = sorted(
                (_ranked(key, value, ids, position) for key, value in entry.items()),
                key=lambda r: r[0],
            )
            ranked = [r for r in ranked if r[0] <= topk]
            if len(ranked) < topk:
                raise _fail(
                    ids,
                    f"sent {len(ranked)} top log-probs at position {position}, fewer than the "
                    f"requested {topk} (is the server's --max-logprobs below {topk}?)",
                )
            top_ids[position] = torch.tensor([r[1] for r in ranked[:topk]])
            top_values[position] = torch.tensor(
                [read_logprob(r[2], ids, position) for r in ranked[:topk]]
            )
    return logprobs, top_ids, top_values


def parse_sglang(ids: list[int], meta: dict, topk: int) -> Scored:
    """One sequence's log-probs and top-k from SGLang's ``meta_info``."""
    token_logprobs = meta.get("input_token_logprobs")
    if not isinstance(token_logprobs, list) or len(token_logprobs) != len(ids):
        count = len(token_logprobs) if isinstance(token_logprobs, list) else "no"
        raise _fail(ids, f"sent {count} input token log-probs for {len(ids)} tokens")
    top = meta.get("input_top_logprobs") or [None] * len(ids)
    if not isinstance(top, list) or len(top) != len(ids):
        raise _fail(ids, "sent 'input_top_logprobs' that is not one list per token")
    logprobs = torch.zeros(len(ids))
    top_ids = torch.zeros(len(ids), max(topk, 1), dtype=torch.long)
    top_values = torch.full((len(ids), max(topk, 1)), -math.inf)
    for position in range(1, len(ids)):
        value, token = _pair(token_logprobs[position], ids, position)
        if token != ids[position]:
            raise _fail(
                ids, f"answered for token id {token} at position {position}, not {ids[position]}"
            )
        logprobs[position] = read_logprob(value, ids, position)
        if topk:
            entries = top[position] or []
            if not isinstance(entries, list) or len(entries) < topk:
                count = len(entries) if isinstance(entries, list) else "no"
                raise _fail(
                    ids, f"sent {count} top log-probs at position {position}, fewer than {topk}"
                )
            pairs = [_pair(e, ids, position) for e in entries[:topk]]
            top_ids[position] = torch.tensor([token_id for _, token_id in pairs])
            top_values[position] = torch.tensor([read_logprob(v, ids, position) for v, _ in pairs])
    return logprobs, top_ids, top_values


def _pair(entry, ids: list[int], position: int) -> tuple[object, int]:
    """SGLang's ``[logprob, token_id, text]`` at ``position``, its id checked."""
    if not isinstance(entry, list | tuple) or len(entry) < 2 or not is_id(entry[1]):
        raise _fail(
            ids, f"sent {str(entry)[:80]} at position {position}, not [logprob, token_id, text]"
        )
    return entry[0], entry[1]


def _ranked(key: str, value, ids: list[int], position: int) -> tuple[float, int, object]:
    """(rank, token id, log-prob) of one vLLM prompt-logprobs entry."""
    token_id = int(key) if isinstance(key, str) and key.isdigit() else None
    if token_id is None or not is_id(token_id) or not isinstance(value, dict):
        raise _fail(ids, f"sent an entry {key!r}: {str(value)[:80]} at position {position}")
    rank = value.get("rank")
    if rank is None:
        rank = math.inf
    if (not isinstance(rank, int) or isinstance(rank, bool)) and rank != math.inf:
        raise _fail(ids, f"sent rank {rank!r} at position {position}, not an integer")
    return rank, token_id, value.get("logprob")


def is_id(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < MAX_TOKEN_ID


def read_logprob(value, ids: list[int], position: int) -> float:
    """A finite log-probability; rounding above 0 (up to ``LOGPROB_ROUNDING``) is read as 0."""
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value < FLOAT32_LOWEST
    ):
        raise _fail(ids, f"log-prob {value!r} at position {position} is not a finite number")
    if value > LOGPROB_ROUNDING:
        raise _fail(
            ids, f"log-prob {value!r} at position {position} is above 0 (not a log-probability)"
        )
    return min(float(value), 0.0)


def parse_prompt_choices(batch: list[list[int]], answer, topk: int) -> list[Scored]:
    """Each sequence's scores from an OpenAI completions answer of one choice per prompt, matched
    by each choice's ``index`` (servers may answer out of order)."""
    choices = answer.get("choices") if isinstance(answer, dict) else None
    if not isinstance(choices, list) or len(choices) != len(batch):
        count = len(choices) if isinstance(choices, list) else "no"
        raise BadAnswer(f"sent {count} choices for {len(batch)} prompts")
    indices = [c.get("index") if isinstance(c, dict) else None for c in choices]
    if sorted(i for i in indices if is_id(i)) != list(range(len(batch))):
        raise BadAnswer(
            f"sent choices indexed {indices[:8]} for {len(batch)} prompts (each index 0..n-1 once)"
        )
    choices = sorted(choices, key=lambda c: c["index"])
    return [
        parse_openai(ids, choice.get("prompt_logprobs"), topk)
        for ids, choice in zip(batch, choices, strict=True)
    ]


def parse_sampled(prompt: list[int], answer) -> tuple[list[int], list[float], bool]:
    """A sampled completion's token ids, their log-probs and whether it stopped by itself, from an
    OpenAI completions answer of one choice."""
    choices = answer.get("choices") if isinstance(answer, dict) else None
    choice = choices[0] if isinstance(choices, list) and len(choices) == 1 else None
    if not isinstance(choice, dict):
        raise _fail(prompt, "sent no single choice for a sampled completion")
    token_ids = choice.get("token_ids")
    if not isinstance(token_ids, list) or not all(is_id(t) for t in token_ids):
        raise _fail(
            prompt,
            "sent no 'token_ids' with its completion (return_token_ids: vLLM 0.10 or later, or opd "
            "serve)",
        )
    logprobs = (choice.get("logprobs") or {}).get("token_logprobs")
    if not isinstance(logprobs, list) or len(logprobs) != len(token_ids):
        count = len(logprobs) if isinstance(logprobs, list) else "no"
        raise _fail(prompt, f"sent {count} log-probs for {len(token_ids)} sampled tokens")
    values = [read_logprob(value, prompt, position) for position, value in enumerate(logprobs)]
    return list(token_ids), values, choice.get("finish_reason") == "stop"


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
            "; start the server with a larger --max-logprobs, or ask for fewer "
            "(training.objective.topk; teacher.character_topk for a cross_tokenizer teacher)"
        )
    if "out of vocabulary" in lowered:
        return (
            "; the server's model has fewer ids than the student's tokenizer: serve a teacher that "
            "shares it, or set cross_tokenizer: true with teacher.tokenizer"
        )
    if "maximum context length" in lowered or "max_model_len" in lowered or "too long" in lowered:
        return "; start the server with a larger --max-model-len, or lower training.max_tokens"
    return ""
