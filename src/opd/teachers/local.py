"""A teacher model in the trainer's process, scored in no-grad forwards."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from opd.data.batching import token_bins
from opd.distributed import all_reduce
from opd.logprobs import (
    ScoredRows,
    backbone_and_head,
    logit_transform_for,
    selected_token_logprobs,
    topk_logprobs,
)
from opd.models import module_device
from opd.packing import packing_problem, use_packed_attention
from opd.teachers.base import TeacherInput, TeacherRequest, TeacherScores

if TYPE_CHECKING:
    from opd.policy.parallel.base import ParallelMode


class LocalTeacher:
    """Log q(x_t | x_<t) of a Hugging Face model for the scored positions of each sequence.

    The model is called through :class:`opd.logprobs.ScoredRows`, the one module call that a
    sharding wrapper applied to ``module`` would see.
    """

    def __init__(
        self,
        model,
        *,
        vocab_size: int,
        pad_id: int,
        batch_size: int = 32,
        chunk_size: int = 1024,
        token_budget: int | None = None,
        packing: bool = True,
    ):
        self.model = model.eval()
        self.module = ScoredRows(self.model)
        self.device = module_device(model)
        self.vocab_size = vocab_size
        self.pad_id = pad_id
        self.batch_size = batch_size
        self.chunk_size = chunk_size
        self.token_budget = token_budget
        """Most tokens per forward (None: ``batch_size`` rows whatever their length)."""
        self.packing_problem: str | None = None
        """Why the teacher's forwards are padded although packing was asked for (None: they are
        not)."""
        self.set_packing(packing)
        self.sharded = False

    def set_packing(self, packing: bool) -> None:
        """Score packed (the rows of a forward laid end to end, no padding) where the model can, or
        padded; the log-probs agree to rounding (``bench/gpu_check.py`` compares the two)."""
        self.packing_problem = packing_problem(self.model) if packing else None
        self.module.packed = packing and self.packing_problem is None
        use_packed_attention(self.model, self.module.packed)

    def shard(self, mode: ParallelMode) -> None:
        """Shard the teacher over the processes as the run's sharding ``mode`` shards the student
        (FSDP2: each holds 1/N of it, gathered a block at a time while it scores). Its forwards
        become collectives: :meth:`score` then runs as many forwards on every process (padding
        with one-token forwards), and every process must call it as many times, in the same
        order."""
        mode.wrap(self.module, self.model, module_device(self.model))
        self.sharded = True

    @property
    def lm_head(self) -> nn.Module:
        """The teacher's output projection (for full-distribution objectives)."""
        return backbone_and_head(self.model)[1]

    @torch.no_grad()
    def score(self, inputs: TeacherInput, request: TeacherRequest) -> TeacherScores:
        """Score up to ``batch_size`` sequences and ``token_budget`` tokens per forward, packed (or
        each forward cut to its longest sequence)."""
        batch, width = inputs.input_ids_BT.shape
        scores = TeacherScores.zeros(batch, width, request)
        token_transform = logit_transform_for(self.model)
        request_transform = logit_transform_for(self.model, request.temperature)
        if request.hidden:
            scores.head, scores.head_transform = self.lm_head, request_transform

        def answer(hidden_ND, token_ids_N, head):
            logprobs_N, _ = selected_token_logprobs(
                hidden_ND,
                head,
                token_ids_N,
                chunk_size=self.chunk_size,
                transform=token_transform,
                vocab_size=self.vocab_size,
                with_entropy=False,
            )
            top = None
            if request.topk:
                top = topk_logprobs(
                    hidden_ND,
                    head,
                    request.topk,
                    chunk_size=self.chunk_size,
                    transform=request_transform,
                    vocab_size=self.vocab_size,
                )
            return logprobs_N, top, hidden_ND if request.hidden else None

        lengths = [int(n) for n in inputs.attention_mask_BT.sum(-1).tolist()]
        forwards = token_bins(
            lengths, self.token_budget, self.batch_size, padded=not self.module.packed
        )
        if self.sharded:
            (most,) = all_reduce([float(len(forwards))], op="max")
            for _ in range(int(most) - len(forwards)):
                self._forward_in_step(answer)
        for members in forwards:
            rows = torch.tensor(members)
            chunk = inputs.select(rows)
            mask = chunk.score_mask_BT.clone()
            mask[:, 0] = False
            (logprobs_N, top, hidden_ND), selected = self.module(
                chunk.input_ids_BT.to(self.device),
                chunk.attention_mask_BT.to(self.device),
                mask.to(self.device),
                answer,
            )
            selected = selected.cpu()
            _place(scores.logprobs_BT, rows, selected, logprobs_N.cpu())
            if top is not None:
                _place(scores.topk_ids_BTK, rows, selected, top[0].cpu())
                _place(scores.topk_logprobs_BTK, rows, selected, top[1].cpu())
            if hidden_ND is not None:
                if scores.hidden_BTD is None:
                    scores.hidden_BTD = hidden_ND.new_zeros(batch, width, hidden_ND.shape[-1])
                _place(
                    scores.hidden_BTD,
                    rows.to(hidden_ND.device),
                    selected.to(hidden_ND.device),
                    hidden_ND,
                )
        return scores

    def _forward_in_step(self, answer) -> None:
        """A one-token forward whose answer is dropped: keeps a sharded teacher's collectives in
        step."""
        ids = torch.full((1, 2), self.pad_id, dtype=torch.long, device=self.device)
        self.module(
            ids, torch.ones_like(ids), torch.tensor([[False, True]], device=self.device), answer
        )


class AdaptersOffTeacher(LocalTeacher):
    """A LoRA student's own base weights as its teacher: the student's model scores with its
    adapters switched off (``disable_adapter``), so ``teacher.model: student`` needs no second copy
    of the weights. Used only where nothing else runs the model meanwhile (synchronous collection,
    weights not sharded: :func:`opd.assemble.teachers.teacher_is_the_students_base`)."""

    def __init__(self, peft_model, **options):
        training = peft_model.training
        super().__init__(peft_model, **options)
        peft_model.train(training)  # the student's mode is the trainer's to set

    def score(self, inputs: TeacherInput, request: TeacherRequest) -> TeacherScores:
        training = self.model.training
        self.model.eval()
        try:
            with self.model.disable_adapter():
                return super().score(inputs, request)
        finally:
            self.model.train(training)


def _place(
    target_BT: torch.Tensor, rows: torch.Tensor, selected: torch.Tensor, values_N: torch.Tensor
) -> None:
    """Write one forward's per-position ``values_N`` into rows ``rows`` of ``target_BT`` at the
    positions ``selected`` (the forward's (n, w - 1) map of positions 1..w - 1)."""
    block = target_BT.new_zeros((selected.shape[0], selected.shape[1], *target_BT.shape[2:]))
    block[selected] = values_N.to(target_BT.dtype)
    target_BT[rows, 1 : selected.shape[1] + 1] = block
