"""``jsd``: GKD's generalized Jensen-Shannon divergence between the full next-token distributions.

With ``M = (1 - beta) S + beta T``: ``JSD = beta KL(T || M) + (1 - beta) KL(S || M)``;
``beta = 0`` is the forward ``KL(T || S)`` and ``beta = 1`` the reverse ``KL(S || T)`` (TRL's
semantics). It reads the teacher's whole distribution, so the teacher runs in the trainer's
process; both heads are applied in chunks with an analytic gradient
(:mod:`opd.objectives.jsd_head`). With a mixture of local teachers ``T`` is the mixed
distribution ``sum_i w_i T_i``; rows of datasets with different teachers each read their own.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from opd.objectives.base import Objective, StudentRows, TargetRows, TokenLosses
from opd.objectives.jsd_head import chunked_jsd_mixed


@dataclass(frozen=True)
class JSD(Objective):
    """Full-distribution generalized JSD at every sampled position."""

    name = "jsd"
    teacher_signal = "distribution"

    beta: float = 0.5
    """0 is forward KL(teacher || student), 1 is reverse KL(student || teacher), in between GKD's
    mixture."""

    def option_problems(self) -> Iterator[tuple[str, str]]:
        if not 0.0 <= self.beta <= 1.0:
            yield "beta", f"must be in [0, 1], got {self.beta}"

    def token_losses(self, student: StudentRows, targets: TargetRows) -> TokenLosses:
        loss_N, logprobs_N, entropy_N = chunked_jsd_mixed(
            student.hidden_ND,
            student.head,
            student.token_ids_N,
            targets.teacher.heads,
            self.beta,
            chunk_size=student.chunk_size,
            transform=student.transform,
            vocab_size=student.vocab_size,
        )
        return TokenLosses(loss_N, logprobs_N, entropy_N)
