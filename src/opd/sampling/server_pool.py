"""Which rollout servers take the student's rows: the ones in rotation, and the ones resting.

A run on several rollout servers outlives the loss of one: a server that stops answering
(connection refused, no answer within ``student.rollout_timeout_s``, an HTTP 5xx) or that
serves weights other than the ones pushed last (restarted, or pushed to by another run) leaves
the rotation with one warning naming it, and its rows go to the others. After
``student.rollout_rest_s`` it is tried again at the next weight push: handshaken as at the
start, sent the current weights and taken back once it serves their tag. When none is left the
run stops naming each server and what it said; the same command resumes it.

Rows go round the servers in rotation offset by the process's rank. A row keeps its seed on
whichever server samples it, so where it lands changes no token.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable

from opd.errors import RolloutServerError
from opd.sampling.rollout_server import RolloutServer


class ServerPool:
    """The rollout servers of one process, and which of them are in rotation. Thread-safe: rows
    are sampled on a pool of threads at once."""

    def __init__(
        self,
        servers: list[RolloutServer],
        rest_s: float,
        rank: int = 0,
        warn: Callable[[str], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.servers = list(servers)
        self.rest_s = rest_s
        self.rank = rank
        self.warn = warn or (lambda message: print(f"opd: warning: {message}", file=sys.stderr))
        self.clock = clock
        self._lock = threading.Lock()
        self._out: dict[str, tuple[float, str]] = {}
        """url -> (when it was taken out or last tried, why)."""

    def live(self) -> list[RolloutServer]:
        """The servers in rotation, in the order they were given."""
        with self._lock:
            return [server for server in self.servers if server.url not in self._out]

    def server_for(self, row: int) -> RolloutServer:
        """Row ``row``'s server: round robin over those in rotation, offset by the rank."""
        live = self.live()
        if not live:
            raise self._none_left()
        return live[(self.rank + row) % len(live)]

    def take_out(self, server: RolloutServer, error: RolloutServerError) -> None:
        """Out of rotation, said once; raises naming every server when none is left."""
        with self._lock:
            was_live = server.url not in self._out
            self._out[server.url] = (self.clock(), str(error))
            left = len(self.servers) - len(self._out)
        if not left:
            raise self._none_left()
        if was_live:
            self.warn(
                f"rollout server {server.url} taken out of rotation ({error}); {left} of "
                f"{len(self.servers)} left, it is tried again at the first weight push after "
                f"{self.rest_s:g} s (student.rollout_rest_s)"
            )

    def resting(self) -> list[RolloutServer]:
        """Servers out of rotation whose rest is over; their rest starts again (one try each)."""
        now = self.clock()
        with self._lock:
            due = [
                s
                for s in self.servers
                if s.url in self._out and now - self._out[s.url][0] >= self.rest_s
            ]
            for server in due:
                self._out[server.url] = (now, self._out[server.url][1])
        return due

    def take_back(self, server: RolloutServer, version: str) -> None:
        with self._lock:
            self._out.pop(server.url, None)
            live = len(self.servers) - len(self._out)
        self.warn(
            f"rollout server {server.url} is back in rotation, serving {version} ({live} of "
            f"{len(self.servers)} live)"
        )

    def keep(self, urls: list[str]) -> None:
        """Make exactly ``urls`` the rotation (the main process's view, after it pushed)."""
        now = self.clock()
        with self._lock:
            for server in self.servers:
                if server.url in urls:
                    self._out.pop(server.url, None)
                elif server.url not in self._out:
                    self._out[server.url] = (now, "the main process could not push to it")

    def verify(self, servers: list[RolloutServer], expected: str) -> set[str]:
        """The URLs of ``servers`` that no longer serve the weights tagged ``expected`` (or do not
        answer), taken out of rotation."""
        stale = set()
        for server in servers:
            try:
                served = server.served_version()
            except RolloutServerError as error:
                if error.fault is None:
                    raise
                self.take_out(server, error)
                stale.add(server.url)
                continue
            if served != expected:
                message = (
                    f"rollout server {server.url} serves weight version {served!r}, not this run's "
                    f"{expected!r}: it was restarted or another run pushed to it; give each run "
                    "its own servers, then run the same command again to resume"
                )
                self.take_out(server, RolloutServerError(message, fault="weights"))
                stale.add(server.url)
        return stale

    def _none_left(self) -> RolloutServerError:
        with self._lock:
            reasons = [self._out[s.url][1] for s in self.servers if s.url in self._out]
        if len(reasons) == 1:
            return RolloutServerError(reasons[0])
        return RolloutServerError(
            "no rollout server is left in rotation (student.rollout_servers): " + "; ".join(reasons)
        )
