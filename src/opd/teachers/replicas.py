"""A remote teacher's replicas: which servers are in rotation, which one a request goes to, and
whether they are one teacher.

``teacher.base_url`` names one server or several. Requests go round the live ones; one that does
not answer (connection refused, timeout, 5xx, a malformed answer) is taken out of rotation with
one warning naming it, and the request goes to the next. A replica out of rotation rests
``replica_rest_s``, then is probed (the start's probe sequence, compared with the answer the run
started with) and taken back when it answers as before. When none answers, requests are retried
on all of them with backoff, ``max_retries`` times, then the run stops naming each.

Replicas must be one teacher: a load balancer in front of servers of different weights (a
half-finished rollout, another revision, a quantized replica) gives each request one of them;
a run would mix their scores without a sign. The same probe, asked several times of each
address on connections of their own, finds it before any step.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from opd.errors import RemoteTeacherError

if TYPE_CHECKING:
    from opd.teachers.remote import RemoteTeacher

DISAGREEMENT_NATS = 0.1
"""Mean absolute gap between two answers' log-probs, per probe token, above which two answers
come from different models. The same weights answer within bf16 noise (docs/teachers.md
gives measured gaps for both)."""


@dataclass
class Replica:
    """One server of a teacher, and whether requests go to it."""

    base_url: str
    live: bool = True
    out_since: float = 0.0
    """``time.monotonic()`` when it was taken out of rotation (its rest starts then)."""


class ReplicaPool:
    """The servers of one teacher: round robin over the live ones, a rest for the others.

    Thread-safe: a teacher's requests come from a pool of threads at once.
    """

    def __init__(
        self,
        base_urls: list[str],
        rest_s: float,
        warn: Callable[[str], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.replicas = [Replica(url.rstrip("/")) for url in base_urls]
        self.rest_s = rest_s
        self.warn = warn or (lambda message: print(f"opd: warning: {message}", file=sys.stderr))
        self.clock = clock
        self._lock = threading.Lock()
        self._turn = 0

    @property
    def several(self) -> bool:
        return len(self.replicas) > 1

    @property
    def live(self) -> int:
        """How many replicas are in rotation."""
        with self._lock:
            return sum(replica.live for replica in self.replicas)

    def choose(self, tried: set[str]) -> tuple[Replica, bool] | None:
        """The next replica to ask that this request has not tried, and whether it must be
        probed first: one out of rotation whose rest is over (its rest restarts, so one request
        probes it); else a live one in turn; else, when none is live, any out of rotation (a
        retry: the one server of a one-address teacher). None: every candidate tried."""
        with self._lock:
            count = len(self.replicas)
            order = [self.replicas[(self._turn + i) % count] for i in range(count)]
            fresh = [r for r in order if r.base_url not in tried]
            now = self.clock()
            for replica in fresh:
                if not replica.live and now - replica.out_since >= self.rest_s:
                    replica.out_since = now
                    return replica, self.several
            for replica in fresh:
                if replica.live:
                    self._turn = (self.replicas.index(replica) + 1) % count
                    return replica, False
            if not any(r.live for r in self.replicas) and fresh:
                return fresh[0], self.several
            return None

    def take_out(self, replica: Replica, reason: str, say: bool = False) -> None:
        """Out of rotation (its rest starts again); said when it was live and has siblings, or
        when ``say`` (a replica back that answers the probe otherwise: kept out, each time)."""
        with self._lock:
            was_live, replica.live, replica.out_since = replica.live, False, self.clock()
            left = sum(r.live for r in self.replicas)
        if (was_live or say) and self.several:
            self.warn(
                f"teacher replica {replica.base_url} taken out of rotation ({reason}); {left} of "
                f"{len(self.replicas)} left, it is probed again after {self.rest_s:g} s"
            )

    def take_back(self, replica: Replica) -> None:
        with self._lock:
            was_live, replica.live = replica.live, True
            live = sum(r.live for r in self.replicas)
        if not was_live and self.several:
            self.warn(
                f"teacher replica {replica.base_url} answers again and is back in rotation ({live} "
                f"of {len(self.replicas)} live)"
            )


def probe_gap(answer_T: torch.Tensor, reference_T: torch.Tensor) -> tuple[float, float]:
    """Mean and largest absolute gap between two answers' log-probs (position 0 has none)."""
    gap_T = (answer_T[1:] - reference_T[1:]).abs()
    return gap_T.mean().item(), gap_T.max().item()


def check_replicas(teacher: RemoteTeacher, probe_ids: list[int], probes: int, where: str) -> None:
    """Score ``probe_ids`` ``probes`` times at each address; raise naming the address when an
    answer disagrees with the first answer, which becomes the reference a replica back from a
    failure is probed against. A replica that does not answer (one of several) starts out of
    rotation, probed against that reference when its rest is over; none answering raises.

    With a round-robin balancer over two replicas behind one address, the second probe already
    meets the other one.
    """
    if probes < 1:
        return
    reference, failures = None, []
    for replica in teacher.pool.replicas:
        for index in range(1, probes + 1):
            try:
                answer = teacher.score_sequence(probe_ids, replica)
            except RemoteTeacherError as error:
                if not teacher.pool.several:
                    raise
                failures.append(str(error))
                teacher.pool.take_out(replica, f"no answer to the start's probe: {error}", say=True)
                break
            if reference is None:
                reference = answer
                continue
            if reference is None:
                reference = answer
                continue
            mean, most = probe_gap(answer, reference)
            if mean > DISAGREEMENT_NATS:
                several = teacher.pool.several
                first = next(r for r in teacher.pool.replicas if r.live)
                which = (
                    f"otherwise than {first.base_url} did"
                    if several and replica is not first
                    else "otherwise"
                )
                raise RemoteTeacherError(
                    f"{where}.base_url: the teacher server {teacher.endpoint_of(replica)} answered "
                    f"the same probe ({len(probe_ids)} tokens) {which} on request {index} of "
                    f"{probes}: log-probs {mean:.3f} nats a token apart on average (at most "
                    f"{most:.3f}), where one model stays within {DISAGREEMENT_NATS}. Replicas "
                    "serve different weights; point base_url at replicas of one checkpoint (or "
                    f"set {where}.replica_probes: 0 to skip this check)"
                )
    if reference is None:
        raise RemoteTeacherError(
            f"{where}.base_url: no teacher replica answered: {'; '.join(failures)}"
        )
    teacher.probe = (probe_ids, reference)
