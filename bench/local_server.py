"""A server process the benches start on a loopback port: a free port, and the wait for it."""

from __future__ import annotations

import socket
import subprocess
import time
import urllib.request
from collections.abc import Callable


def free_port() -> int:
    """A port nothing listens on now (the OS picks it), on loopback."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def wait_for_health(
    process: subprocess.Popen,
    port: int,
    timeout_s: float,
    why_exited: Callable[[], str] = lambda: "",
) -> None:
    """Return once ``/health`` answers on ``port``; stop the bench with what went wrong if the
    server exits first (``why_exited``: e.g. its log's tail) or does not answer in time."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"the server exited with {process.returncode}\n{why_exited()}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
            return
        except OSError:
            time.sleep(0.2)
    process.kill()
    raise SystemExit(f"the server did not answer on port {port} in {timeout_s:g} s")
