"""``sampled_reverse_kl``: the teacher's judgement of each sampled token as a policy-gradient
advantage.

The advantage of token t is ``-kl_penalty_coef * (log p_student(x_t) - log q_teacher(x_t))``
(optionally discounted over the tokens after it), and ``training.loss_fn`` turns it into a loss
on the student's own samples; its expected gradient is that of the reverse KL
``KL(student || teacher)``. Any teacher serves it: only the sampled tokens' log-probs are read.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from opd.objectives.advantages import kl_advantages
from opd.objectives.base import Objective, StudentRows, TargetRows, TokenLosses
from opd.objectives.policy_losses import PolicyGradient
from opd.teachers.base import TeacherScores


@dataclass(frozen=True)
class SampledReverseKL(Objective):
    """Negative per-token reverse KL as the advantage of a policy-gradient loss (the reference
    recipe)."""

    name = "sampled_reverse_kl"
    teacher_signal = "logprobs"
    samples = "student"
    samples_reason = "is a policy gradient on the student's own samples"
    uses_advantages = True

    def advantages(
        self,
        sampled_logprobs_BT: torch.Tensor,
        teacher: TeacherScores,
        mask_BT: torch.Tensor,
        policy_gradient: PolicyGradient,
    ) -> torch.Tensor:
        """``-coef * reverse KL`` per token, discounted when ``kl_discount_factor > 0``, clamped
        when ``advantage_clip`` is set."""
        return kl_advantages(
            sampled_logprobs_BT,
            teacher.logprobs_BT,
            mask_BT,
            kl_penalty_coef=policy_gradient.kl_penalty_coef,
            kl_discount_factor=policy_gradient.kl_discount_factor,
            clip=policy_gradient.advantage_clip,
        )

    def token_losses(self, student: StudentRows, targets: TargetRows) -> TokenLosses:
        logprobs_N, entropy_N = student.logprobs()
        loss_N = targets.policy_loss(logprobs_N)
        return TokenLosses(loss_N, logprobs_N, entropy_N)
