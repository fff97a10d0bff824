"""``nll``: the negative log-likelihood of given completions (SFT on a teacher's or a dataset's).

No teacher forward is paid for: only the tokens are read. On the student's own samples it
would fit the student to itself, so it takes teacher or dataset completions only.
"""

from __future__ import annotations

from dataclasses import dataclass

from opd.objectives.base import Objective, StudentRows, TargetRows, TokenLosses


@dataclass(frozen=True)
class NLL(Objective):
    """Supervised fine-tuning: minimise ``-log p_student`` of every completion token."""

    name = "nll"
    teacher_signal = "none"
    samples = "reference"
    samples_reason = "would fit the student to itself without the teacher"

    def token_losses(self, student: StudentRows, targets: TargetRows) -> TokenLosses:
        logprobs_N, entropy_N = student.logprobs()
        return TokenLosses(-logprobs_N, logprobs_N, entropy_N)
