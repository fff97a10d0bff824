"""The wire formats ``opd serve`` speaks: vLLM's ``/v1/completions`` (prompt log-probs, or sampled
completions) and ``/models``, SGLang's ``/generate``; each request checked field by field and
refused as vLLM words it."""

from __future__ import annotations

import json
import time
import uuid

from transformers import StopStringCriteria

from opd.serve.fields import RequestError, count_field, flag_field, token_ids
from opd.serve.model import ScoringModel


def completions_response(scorer: ScoringModel, body: dict) -> dict:
    """The answer to ``POST /v1/completions``: prompts scored, or completions sampled."""
    if body.get("model") not in (None, scorer.name):
        raise RequestError(
            f"The model `{body.get('model')}` does not exist. Valid aliases: {scorer.name}.",
            404,
            "model",
        )
    prompt = body.get("prompt")
    prompts = (
        prompt if isinstance(prompt, list) and prompt and isinstance(prompt[0], list) else [prompt]
    )
    prompts = [token_ids(p, "prompt", scorer) for p in prompts]
    for field, default in (
        ("return_token_ids", False),
        ("skip_special_tokens", True),
        ("echo", False),
    ):
        flag_field(body, field, default)  # checked before any work
    k = body.get("prompt_logprobs")
    if k is None:
        return sampled_response(scorer, body, prompts)
    if not isinstance(k, int) or isinstance(k, bool) or k < 0:
        raise RequestError("'prompt_logprobs' must be a non-negative integer")
    if k > scorer.max_logprobs:
        raise RequestError(
            f"Requested prompt logprobs of {k}, which is greater than max allowed: "
            f"{scorer.max_logprobs} (parameter=prompt_logprobs, value={k})",
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
                entry.setdefault(
                    str(tid), {"logprob": lp, "rank": top_rank, "decoded_token": decode([tid])}
                )
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
                "prompt_token_ids": ids if flag_field(body, "return_token_ids") else None,
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


def _max_tokens(body: dict, scorer: ScoringModel, prompts: list[list[int]]) -> int:
    """``max_tokens`` of a sampling request, within the context left after its longest prompt and
    within the server's per-request budget (``ignore_eos`` can make every row sample all of it)."""
    max_tokens = count_field(body, "max_tokens", 16)
    if max_tokens < 1:
        raise RequestError(
            "'max_tokens' must be at least 1 to sample (or set 'prompt_logprobs' to score)"
        )
    longest = max(len(p) for p in prompts)
    if scorer.max_model_len and longest + max_tokens > scorer.max_model_len:
        raise RequestError(
            f"This model's maximum context length is {scorer.max_model_len} tokens. However, you "
            f"requested {longest + max_tokens} tokens ({longest} in the prompt, {max_tokens} in "
            f"the completion): 'max_tokens' can be at most {scorer.max_model_len - longest} after "
            "this prompt.",
            param="max_tokens",
        )
    total = max_tokens * len(prompts)
    if total > scorer.max_tokens_per_request:
        raise RequestError(
            f"this request may sample {total} tokens ({len(prompts)} prompts x max_tokens "
            f"{max_tokens}), over this server's limit of {scorer.max_tokens_per_request} a request "
            "(opd serve --max-tokens-per-request): send fewer prompts a request or a smaller "
            "max_tokens",
            param="max_tokens",
        )
    return max_tokens


def _sampling(
    body: dict, scorer: ScoringModel, prompts: list[list[int]]
) -> tuple[float, int, int | None, list[int], list[str]]:
    """``(temperature, max_tokens, seed, stop ids, stop strings)`` of a sampling request,
    checked."""
    for field, neutral in NEUTRAL_SAMPLING.items():
        value = body.get(field)
        if value is not None and (
            isinstance(value, bool) != isinstance(neutral[0], bool) or value not in neutral
        ):
            raise RequestError(
                f"'{field}' must be {neutral[0]!r} here (this server samples softmax(logits / "
                f"temperature) only), got {json.dumps(value)[:40]}",
                param=field,
            )
    if body.get("logprobs") not in (None, 0) or body.get("allowed_token_ids") is not None:
        field = "logprobs" if body.get("logprobs") not in (None, 0) else "allowed_token_ids"
        raise RequestError(
            f"'{field}' is not served here: the sampled tokens' log-probs only (logprobs: 0)",
            param=field,
        )
    temperature = body.get("temperature", 1.0)
    if (
        isinstance(temperature, bool)
        or not isinstance(temperature, int | float)
        or not 0 <= temperature < 1e6
    ):
        raise RequestError(
            f"'temperature' must be a number >= 0, got {json.dumps(temperature)[:40]}",
            param="temperature",
        )
    max_tokens = _max_tokens(body, scorer, prompts)
    seed = body.get("seed")
    if seed is not None and (
        isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63
    ):
        raise RequestError(
            f"'seed' must be an integer in [0, 2**63), got {json.dumps(seed)[:40]}", param="seed"
        )
    stops = body.get("stop_token_ids") or []
    if stops:
        stops = token_ids(stops, "stop_token_ids", scorer)
    strings = body.get("stop") or []
    strings = [strings] if isinstance(strings, str) else strings
    if not isinstance(strings, list) or not all(isinstance(s, str) and s for s in strings):
        raise RequestError("'stop' must be a string or a list of non-empty strings", param="stop")
    if strings:
        try:  # what generate() builds from them: it refuses strings no token can write
            StopStringCriteria(scorer.tokenizer, strings)
        except ValueError as error:
            raise RequestError(f"'stop': {error}"[:300], param="stop") from None
    eos = scorer.tokenizer.eos_token_id
    if not flag_field(body, "ignore_eos") and eos is not None and eos not in stops:
        stops = [*stops, eos]
    if not stops:
        raise RequestError(
            "nothing ends a completion: give 'stop_token_ids', or leave 'ignore_eos' false"
        )
    return float(temperature), max_tokens, seed, stops, strings


def sampled_response(scorer: ScoringModel, body: dict, prompts: list[list[int]]) -> dict:
    """The answer to a ``POST /v1/completions`` that samples: one choice per prompt, in vLLM's shape
    (``token_ids`` with ``return_token_ids``; the stop token kept in them)."""
    temperature, max_tokens, seed, stops, strings = _sampling(body, scorer, prompts)
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
                "text": decode(
                    shown, skip_special_tokens=flag_field(body, "skip_special_tokens", True)
                ),
                "logprobs": logprobs,
                "finish_reason": "stop" if completion.finished else "length",
                "stop_reason": None,
                "token_ids": ids if flag_field(body, "return_token_ids") else None,
                "prompt_logprobs": None,
                "prompt_token_ids": prompts[index]
                if flag_field(body, "return_token_ids")
                else None,
                "routed_experts": None,
            }
        )
    sampled = sum(len(c.token_ids) for c in completions)
    return completion_body(scorer, choices, sum(len(p) for p in prompts), sampled)


def generate_response(scorer: ScoringModel, body: dict) -> dict:
    """The answer to SGLang's ``POST /generate`` for one prompt."""
    ids = token_ids(body.get("input_ids"), "input_ids", scorer)
    if body.get("return_logprob") is not True:
        raise RequestError("this server only scores prompts: set 'return_logprob': true")
    start = count_field(body, "logprob_start_len", 0)
    k = count_field(body, "top_logprobs_num", 0, scorer.max_logprobs)
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
