"""Replicas behind one address must be one teacher: the same probe asked several times, compared.

A load balancer in front of teacher servers that serve different weights (a half-finished
rollout, another revision, a quantized replica) gives each request one of them at random; a run
would mix their scores without a sign. Asking the same sequence a few times, each request on a
connection of its own, finds it before any step.
"""

from __future__ import annotations

from opd.errors import RemoteTeacherError
from opd.teachers.remote import RemoteTeacher

DISAGREEMENT_NATS = 0.1
"""Mean absolute gap between two answers' log-probs, per probe token, above which two answers
come from different models. The same weights answer within bf16 noise (docs/teachers.md
gives measured gaps for both)."""


def check_replicas(teacher: RemoteTeacher, probe_ids: list[int], probes: int, where: str) -> None:
    """Score ``probe_ids`` ``probes`` times; raise naming the address when two answers disagree.

    The first answer is the reference; each later one is compared with it, so with a round-robin
    balancer over two replicas the second probe already meets the other one.
    """
    if probes < 1:
        return
    answers = [teacher.score_sequence(probe_ids) for _ in range(probes)]
    first = answers[0][1:]
    for index, answer in enumerate(answers[1:], start=2):
        gap_T = (answer[1:] - first).abs()
        mean, most = gap_T.mean().item(), gap_T.max().item()
        if mean > DISAGREEMENT_NATS:
            raise RemoteTeacherError(
                f"{where}.base_url: the teacher server {teacher.endpoint} answered the same probe "
                f"({len(probe_ids)} tokens) otherwise on request {index} of {probes}: log-probs "
                f"{mean:.3f} nats a token apart on average (at most {most:.3f}), "
                f"where one model stays within {DISAGREEMENT_NATS}. Replicas behind this address "
                "serve different weights; point base_url at one replica or make them serve the same "
                f"checkpoint (or set {where}.replica_probes: 0 to skip this check)"
            )
