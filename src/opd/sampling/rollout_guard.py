"""What a rollout server lets a client do: load weight files only from the directory fixed when
it started, and, once an API key is set, answer no route without it.

vLLM's own ``--api-key`` guards the ``/v1`` routes only; the weight-update, pause and RPC routes
a rollout server needs (``VLLM_SERVER_DEV_MODE=1``) stay open. :class:`RolloutAuth`, an ASGI
middleware ``opd rollout-server`` adds to vLLM's server (``--middleware``), asks every route but
``/health`` for the key in ``VLLM_API_KEY``. Nothing here imports vLLM: the trainer reads the same
defaults.
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
import os
import secrets
import tempfile
from pathlib import Path

WEIGHTS_DIR_ENV = "OPD_ROLLOUT_WEIGHTS_DIR"
"""The directory a rollout server loads weight files from, set by ``opd rollout-server
--weights-dir``."""
KEY_ENV = "VLLM_API_KEY"
"""The server's API key: vLLM reads it for its ``/v1`` routes, :class:`RolloutAuth` for the rest."""
OPEN_PATHS = ("/health",)
"""Routes answered without the key (a load balancer's liveness probe)."""
MIDDLEWARE = f"{__name__}.RolloutAuth"


def default_weights_root() -> Path:
    """Where a trainer writes pushed weights and a server reads them unless told otherwise: a
    directory of opd's own in ``/dev/shm`` (memory), or in the system's temporary directory."""
    shm = Path("/dev/shm")
    return (shm if shm.is_dir() else Path(tempfile.gettempdir())) / "opd-rollout-weights"


def weights_root() -> Path:
    """The directory this server loads weights from: ``OPD_ROLLOUT_WEIGHTS_DIR``, else the
    default."""
    return Path(os.environ.get(WEIGHTS_DIR_ENV) or default_weights_root()).resolve()


def files_outside(paths: list, root: Path) -> list:
    """The entries that are not paths under ``root`` once every link is followed (``..``
    included): anything else a request sends (a number, a name with a NUL byte) is outside."""

    def inside(path) -> bool:
        try:
            return isinstance(path, str) and Path(os.path.realpath(path)).is_relative_to(root)
        except (ValueError, OSError):  # an embedded NUL byte, a name too long
            return False

    return [path for path in paths if not inside(path)]


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` keeps the server reachable from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to any interface


class RolloutAuth:
    """ASGI middleware: with ``VLLM_API_KEY`` set, a request to any route but ``/health`` without
    ``Authorization: Bearer <key>`` gets 401 (compared in constant time); without a key, it passes
    everything on (``opd rollout-server`` then binds loopback only)."""

    def __init__(self, app) -> None:
        self.app = app
        key = os.environ.get(KEY_ENV)
        self.key_hash = hashlib.sha256(key.encode()).digest() if key else None

    def allowed(self, scope: dict) -> bool:
        if self.key_hash is None or scope.get("method") == "OPTIONS":
            return True
        path = scope["path"].removeprefix(scope.get("root_path", ""))
        if path in OPEN_PATHS:
            return True
        headers = dict(scope.get("headers") or [])
        scheme, _, token = headers.get(b"authorization", b"").decode("latin-1").partition(" ")
        given = hashlib.sha256(token.encode("latin-1")).digest()
        return scheme.lower() == "bearer" and secrets.compare_digest(given, self.key_hash)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] not in ("http", "websocket") or self.allowed(scope):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})  # policy violation
            return
        body = json.dumps({"error": "Unauthorized: this rollout server wants its API key"}).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})
