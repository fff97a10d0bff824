"""``k3``: the differentiable k3 estimate of the KL on the sampled tokens (torchrl's distillation
loss).

``k3(target, log_prob) = exp(d) - 1 - d`` with ``d = target - log_prob`` estimates
``KL(sampling || target)`` when the tokens were drawn from the distribution behind ``log_prob``.
Backpropagated through the student on its own samples, its expected gradient is the forward
KL's whatever ``kl_direction`` says (the direction changes the logged value); only the sampled
tokens' log-probs are read, so any teacher serves it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from opd.objectives.base import Objective, StudentRows, TargetRows, TokenLosses


def k3_kl_token_estimate(target_log_prob: torch.Tensor, log_prob: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate ``exp(d) - 1 - d``, ``d = target_log_prob - log_prob``.

    Estimates KL(sampling || target) when the tokens were sampled from the distribution
    behind ``log_prob``; nonnegative everywhere.
    """
    if target_log_prob.shape != log_prob.shape:
        raise ValueError(
            "target_log_prob and log_prob must have the same shape, got "
            f"{tuple(target_log_prob.shape)} and {tuple(log_prob.shape)}"
        )
    difference = target_log_prob - log_prob
    return difference.expm1() - difference


@dataclass(frozen=True)
class K3(Objective):
    """The k3 estimate on the sampled tokens, differentiated through the student."""

    name = "k3"
    teacher_signal = "logprobs"

    kl_direction: Literal["reverse", "forward"] = "reverse"
    """``reverse`` is k3(teacher, student), an estimate of KL(student || teacher) on student
    samples; ``forward`` is k3(student, teacher), KL(teacher || student) on teacher samples."""

    def token_losses(self, student: StudentRows, targets: TargetRows) -> TokenLosses:
        logprobs_N, entropy_N = student.logprobs()
        teacher_N = targets.teacher.logprobs_N
        if self.kl_direction == "reverse":
            loss_N = k3_kl_token_estimate(teacher_N, logprobs_N)
        else:
            loss_N = k3_kl_token_estimate(logprobs_N, teacher_N)
        return TokenLosses(loss_N, logprobs_N, entropy_N)
