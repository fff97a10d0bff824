"""One step's finished batch: what the loop's two halves pass between them (collect, then learn)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from opd.data.sequences import RolloutBatch
from opd.objectives.advantages import reverse_kl_per_token
from opd.teachers.base import TeacherScores


@dataclass
class Batch:
    """One step's finished batch: everything :meth:`Trainer.learn` needs, nothing it must fetch."""

    step: int
    source: str
    """Who wrote the completions: ``student``, ``teacher`` or ``dataset``."""
    rollouts: RolloutBatch
    teacher: TeacherScores | None
    """The teachers' answer, as the objective asked for it (None: it needs none)."""
    seconds: dict[str, float]
    """``time/sample`` (which includes ``time/weight_sync`` on student batches) and
    ``time/teacher``."""
    staleness: int | None = None
    """Collected ahead: how many updates the weights that sampled it lag behind (None:
    synchronous)."""
    rewards_B: torch.Tensor | None = None
    """The task's reward of each of the student's own samples (NaN where its dataset gives none;
    None: no dataset of the run gives rewards, or the student did not write the batch)."""
    groups_B: torch.Tensor | None = None
    """Each row's group (the index of its prompt in the step), for centring rewards within
    groups."""

    @property
    def on_policy(self) -> bool:
        """Whether the student sampled the batch itself."""
        return self.source == "student"

    @property
    def reverse_kl_BT(self) -> torch.Tensor | None:
        """The sampled-token reverse KL ``log p - log q`` per completion token (None without a
        teacher)."""
        if self.teacher is None:
            return None
        return reverse_kl_per_token(
            self.rollouts.sampled_logprobs_BT, self.teacher.logprobs_BT, self.rollouts.mask_BT
        )
