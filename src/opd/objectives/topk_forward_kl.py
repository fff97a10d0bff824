"""``topk_forward_kl``: the forward KL over the teacher's k most likely tokens plus one tail bucket.

Both distributions are collapsed to k + 1 outcomes, the teacher's top-k tokens and "anything
else", so only the teacher's top-k ids and log-probs are needed: what a vLLM or SGLang server
can send. The student's head is applied in chunks with an analytic gradient
(:mod:`opd.objectives.topk_head`).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from opd.objectives.base import Objective, StudentRows, TargetRows, TokenLosses
from opd.objectives.topk_head import chunked_topk_forward_kl
from opd.teachers.base import TeacherRequest


@dataclass(frozen=True)
class TopKForwardKL(Objective):
    """Forward KL(teacher || student) over the teacher's top-k tokens and a tail bucket."""

    name = "topk_forward_kl"
    teacher_signal = "topk"

    topk: int = 32
    """Teacher tokens kept per position (the rest is one bucket); a server's ``--max-logprobs`` caps
    it."""

    def option_problems(self) -> Iterator[tuple[str, str]]:
        if self.topk <= 0:
            yield "topk", f"must be > 0, got {self.topk}"

    def vocabulary_problems(self, vocab_size: int) -> Iterator[tuple[str, str]]:
        if self.topk > vocab_size:
            yield "topk", f"{self.topk} is larger than the vocabulary ({vocab_size} tokens)"

    def teacher_request(self, temperature: float) -> TeacherRequest:
        return TeacherRequest(topk=self.topk, temperature=temperature)

    def token_losses(self, student: StudentRows, targets: TargetRows) -> TokenLosses:
        loss_N, logprobs_N, entropy_N = chunked_topk_forward_kl(
            student.hidden_ND,
            student.head,
            student.token_ids_N,
            targets.teacher.topk_ids_NK,
            targets.teacher.topk_logprobs_NK,
            chunk_size=student.chunk_size,
            transform=student.transform,
            vocab_size=student.vocab_size,
        )
        return TokenLosses(loss_N, logprobs_N, entropy_N)
