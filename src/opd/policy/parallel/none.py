"""``training.parallel: none``: one process, the whole student, nothing shared."""

from __future__ import annotations

from opd.policy.parallel.base import ParallelMode


class NoParallel(ParallelMode):
    """One process holds the whole student."""

    name = "none"
