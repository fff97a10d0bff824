"""What every teacher backend answers: log-probs of given token ids, top-k, hidden states."""

from __future__ import annotations

from typing import Protocol

from opd.teachers.local import TeacherScores


class Teacher(Protocol):
    """A teacher backend (``LocalTeacher``, ``RemoteTeacher``).

    ``score`` returns, per sequence, log q(x_t | x_<t) where ``score_masks`` is set, plus the
    top-k (``topk > 0``) and final hidden states (``hidden``, local teachers only) of those
    positions; see :class:`opd.teachers.local.TeacherScores`.
    """

    def score(
        self,
        sequences: list[list[int]],
        score_masks: list[list[bool]],
        *,
        topk: int = 0,
        hidden: bool = False,
        temperature: float = 1.0,
    ) -> TeacherScores: ...
