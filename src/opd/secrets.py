"""Secrets kept out of everything a run writes or prints.

API keys are only read from environment variables named in the config (``teacher.api_key_env``)
and only ever sent in a request header. What a user may still write into a config by habit,
credentials in a URL (``https://user:token@host``) or a token in its query string, is masked
wherever a config or a URL is recorded: the saved ``config.yaml``, W&B / MLflow parameters,
and error messages.
"""

from __future__ import annotations

import re
from typing import Any

MASK = "***"
_USERINFO = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)[^/@\s]+@")
_SECRET_QUERY = re.compile(
    r"(?P<name>[?&](?:api[_-]?key|key|token|access[_-]?token|auth|password|secret|sig|signature)"
    r"=)[^&#\s]+",
    re.IGNORECASE,
)


def redact(text: str) -> str:
    """``text`` with URL credentials and secret-looking query parameters masked."""
    text = _USERINFO.sub(lambda m: f"{m['scheme']}{MASK}@", text)
    return _SECRET_QUERY.sub(lambda m: f"{m['name']}{MASK}", text)


def redact_values(data: Any) -> Any:
    """A copy of a plain mapping / list structure with every string passed through
    :func:`redact`."""
    if isinstance(data, dict):
        return {key: redact_values(value) for key, value in data.items()}
    if isinstance(data, list | tuple):
        return [redact_values(value) for value in data]
    return redact(data) if isinstance(data, str) else data
