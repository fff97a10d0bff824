"""A request's fields read one by one, each checked and bounded before anything runs, and the
refusal vLLM would answer when one is wrong: what every route of ``opd serve`` shares."""

from __future__ import annotations

import json

from opd.serve.model import ScoringModel


class RequestError(ValueError):
    """A request refused: answered with ``status`` (400 unless said) and this message, as vLLM words
    it."""

    def __init__(self, message: str, status: int = 400, param: str | None = None):
        super().__init__(message)
        self.status = status
        self.param = param


def error_body(message: str, status: int, param: str | None = None) -> dict:
    """vLLM's error JSON: ``{"error": {"message", "type", "param", "code"}}``."""
    kind = {404: "NotFoundError", 503: "ServiceUnavailableError"}.get(status, "BadRequestError")
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def token_ids(value, field: str, scorer: ScoringModel) -> list[int]:
    if (
        not isinstance(value, list)
        or not value
        or not all(isinstance(t, int) and not isinstance(t, bool) for t in value)
    ):
        raise RequestError(f"'{field}' must be a non-empty list of token ids")
    bad = [t for t in value if not 0 <= t < scorer.vocab_size]
    if bad:
        raise RequestError(
            f"Token id {bad[0]} is out of vocabulary (the model has {scorer.vocab_size} ids)"
        )
    if scorer.max_model_len and len(value) > scorer.max_model_len:
        raise RequestError(
            f"This model's maximum context length is {scorer.max_model_len} tokens. However, you "
            "requested "
            f"{len(value)} tokens in the prompt.",
            param=field,
        )
    return value


def count_field(body: dict, field: str, default: int, most: int | None = None) -> int:
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


def flag_field(body: dict, field: str, default: bool = False) -> bool:
    """A boolean field of the request (``default`` when absent or null); vLLM refuses other
    types."""
    value = body.get(field)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise RequestError(
            f"'{field}' must be true or false, got {json.dumps(value)[:40]}", param=field
        )
    return value
