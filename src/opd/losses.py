"""Token-level distillation losses with torchrl's semantics, on plain tensors or chat histories.

- :func:`k3_kl_token_estimate`: ``expm1(d) - d`` with ``d = target - log_prob``.
- :func:`distillation_loss`: masked per-token k3, summed per sequence, optionally divided by
  the sequence's scored tokens, then reduced (``mean`` / ``sum`` / ``none``).
- :class:`ChatDistillationLoss` and :func:`teacher_chat_logprobs`: the same loss from chat
  histories, with assistant masks read from the chat template (like torchrl's
  ``DistillationLoss`` with ``RetrieveLogProb``).

Note, as in the seed: backpropagating k3 through the student on its own samples gives, in
expectation, the forward-KL gradient whatever ``kl_direction`` says; the direction changes
the logged value. The sampled-token policy-gradient objective of the trainer
(``sampled_reverse_kl``) is the one that follows the reverse KL.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from opd.data.sequences import pad_right
from opd.logprobs import sequence_logprobs
from opd.models import module_device
from opd.objectives.k3 import k3_kl_token_estimate

__all__ = [
    "ChatDistillationLoss",
    "DistillationOutput",
    "distillation_loss",
    "k3_kl_token_estimate",
    "teacher_chat_logprobs",
    "tokenize_chats",
]

KLDirection = Literal["reverse", "forward"]
Reduction = Literal["mean", "sum", "none"]
ZERO_FILL_FRACTION = 0.9


@dataclass
class DistillationOutput:
    """``loss_distill`` to backpropagate; ``kl_to_teacher`` (detached mean per-sequence KL) to
    log."""

    loss_distill: torch.Tensor
    kl_to_teacher: torch.Tensor


TensorOrList = torch.Tensor | Sequence[torch.Tensor]


def _as_rows(values: TensorOrList | None) -> list[torch.Tensor] | None:
    if values is None:
        return None
    if isinstance(values, torch.Tensor):
        return list(values.unbind(0)) if values.dim() > 1 else [values]
    return list(values)


def _check_zero_filled(teacher, masks, assistant_masks) -> None:
    """Refuse teacher log-probs that were zero-filled off the assistant turns but scored anyway."""
    total = zeros = 0
    for teacher_row, mask, assistant in zip(teacher, masks, assistant_masks, strict=True):
        non_assistant = mask & ~assistant
        total += int(non_assistant.sum())
        zeros += int(((teacher_row == 0.0) & non_assistant).sum())
    if total and zeros > ZERO_FILL_FRACTION * total:
        raise RuntimeError(
            f"{zeros} of {total} scored non-assistant tokens have a teacher log-prob of exactly "
            "0.0: the teacher log-probs were zero-filled outside assistant turns "
            "(assistant_only=True when scoring) but this loss has assistant_only=False and scores "
            "those tokens. Use assistant_only=True here, or recompute the teacher log-probs with "
            "assistant_only=False."
        )


def distillation_loss(
    student_log_probs: TensorOrList,
    teacher_log_probs: TensorOrList | None,
    mask: TensorOrList,
    *,
    kl_direction: KLDirection = "reverse",
    reduction: Reduction = "mean",
    normalize_by_seq_length: bool = True,
    assistant_mask: TensorOrList | None = None,
    assistant_only: bool = True,
) -> DistillationOutput:
    """k3 distillation loss over sequences: padded (B, T) tensors with a mask, or lists of 1-D
    tensors.

    ``reverse`` is ``k3(teacher, student)`` (KL(student || teacher) on student samples);
    ``forward`` is ``k3(student, teacher)`` (KL(teacher || student) on teacher samples).
    Gradients flow through the student only. With ``assistant_only=False`` and an
    ``assistant_mask``, zero-filled teacher log-probs on non-assistant tokens are refused.
    """
    if kl_direction not in ("reverse", "forward"):
        raise ValueError(f"kl_direction must be 'reverse' or 'forward', got {kl_direction!r}")
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    if teacher_log_probs is None:
        raise ValueError(
            "teacher log-probs are missing: score the same token ids with the teacher first, e.g. "
            "opd.losses.teacher_chat_logprobs(teacher, tokenizer, chats) or "
            "opd.logprobs.sequence_logprobs(teacher, ids, attention_mask, mask) under "
            "torch.no_grad()"
        )
    students, teachers, masks = (
        _as_rows(student_log_probs),
        _as_rows(teacher_log_probs),
        _as_rows(mask),
    )
    if len(students) != len(teachers) or any(
        s.shape != t.shape for s, t in zip(students, teachers, strict=False)
    ):
        raise ValueError(
            "student and teacher log-probs have different shapes: "
            f"{[tuple(s.shape) for s in students]} vs {[tuple(t.shape) for t in teachers]}; both "
            "models must score the same token ids"
        )
    if len(masks) != len(students) or any(
        m.shape != s.shape for m, s in zip(masks, students, strict=False)
    ):
        raise ValueError(
            f"masks and log-probs have different shapes: {[tuple(m.shape) for m in masks]} vs "
            f"{[tuple(s.shape) for s in students]}"
        )
    masks = [m.bool() for m in masks]
    empty = [i for i, m in enumerate(masks) if not m.any()]
    if empty:
        raise ValueError(
            f"sequences {empty} have no token selected for distillation; check their masks"
        )
    if not assistant_only and assistant_mask is not None:
        _check_zero_filled(teachers, masks, [m.bool() for m in _as_rows(assistant_mask)])
    per_sequence = []
    for student, teacher, selected in zip(students, teachers, masks, strict=True):
        student = student.masked_fill(~selected, 0.0)
        teacher = teacher.detach().masked_fill(~selected, 0.0)
        if kl_direction == "reverse":
            kl = k3_kl_token_estimate(teacher, student)
        else:
            kl = k3_kl_token_estimate(student, teacher)
        total = kl.sum()
        per_sequence.append(total / selected.sum() if normalize_by_seq_length else total)
    summed = torch.stack(per_sequence)
    loss = {"mean": summed.mean, "sum": summed.sum, "none": lambda: summed}[reduction]()
    return DistillationOutput(loss_distill=loss, kl_to_teacher=summed.detach().mean())


@dataclass
class ChatTokens:
    """A tokenized batch of chats: per-chat ids, attention and assistant masks (1-D each)."""

    input_ids: list[torch.Tensor]
    attention_mask: list[torch.Tensor]
    assistant_mask: list[torch.Tensor]


def tokenize_chats(
    tokenizer, chats: Sequence[Sequence[dict]], chat_template: str | None = None
) -> ChatTokens:
    """Render and tokenize full chats; mark tokens inside assistant turns.

    The assistant span of message i is found by rendering the chat up to message i - 1 with
    a generation prompt (where the reply starts) and up to message i (where it ends), which
    works for any template that renders a conversation as a prefix of its continuation.
    """
    template = {"chat_template": chat_template} if chat_template else {}
    ids_list, attention_list, assistant_list = [], [], []
    for number, chat in enumerate(chats):
        text = tokenizer.apply_chat_template(list(chat), tokenize=False, **template)
        encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = encoded["input_ids"]
        assistant = torch.zeros(len(ids), dtype=torch.bool)
        for index, message in enumerate(chat):
            if message["role"] != "assistant":
                continue
            before = tokenizer.apply_chat_template(
                list(chat[:index]), tokenize=False, add_generation_prompt=True, **template
            )
            through = tokenizer.apply_chat_template(
                list(chat[: index + 1]), tokenize=False, **template
            )
            if not (text.startswith(before) and text.startswith(through)):
                raise ValueError(
                    f"chat {number}: the template does not render message {index} as a prefix of "
                    "the whole chat, so its assistant tokens cannot be located; pass "
                    "assistant_masks"
                )
            for position, (start, end) in enumerate(encoded["offset_mapping"]):
                if start >= len(before) and end <= len(through) and end > start:
                    assistant[position] = True
        ids_list.append(torch.tensor(ids))
        attention_list.append(torch.ones(len(ids), dtype=torch.bool))
        assistant_list.append(assistant)
    return ChatTokens(ids_list, attention_list, assistant_list)


def _score(
    model: nn.Module, ids: list[torch.Tensor], masks: list[torch.Tensor], pad_id: int
) -> list[torch.Tensor]:
    """Log-probs of each chat's tokens where ``masks`` is set (position 0 is never scored)."""
    device = module_device(model)
    padded_ids, attention = pad_right([row.tolist() for row in ids], pad_id)
    padded_masks, _ = pad_right([row.int().tolist() for row in masks], 0)
    logprobs, _ = sequence_logprobs(
        model, padded_ids.to(device), attention.to(device), padded_masks.to(device)
    )
    return [logprobs[row, : len(seq)].cpu() for row, seq in enumerate(ids)]


@torch.no_grad()
def teacher_chat_logprobs(
    teacher: nn.Module,
    tokenizer,
    chats: Sequence[Sequence[dict]],
    *,
    assistant_only: bool = True,
    chat_template: str | None = None,
) -> list[torch.Tensor]:
    """Teacher per-token log-probs of each chat (like torchrl's ``RetrieveLogProb``).

    With ``assistant_only`` the log-probs outside assistant turns are zero-filled.
    """
    tokens = tokenize_chats(tokenizer, chats, chat_template)
    masks = tokens.assistant_mask if assistant_only else tokens.attention_mask
    return _score(teacher, tokens.input_ids, masks, tokenizer.pad_token_id or 0)


class ChatDistillationLoss(nn.Module):
    """Distil a student towards a teacher on chat histories (torchrl ``DistillationLoss`` knobs).

    Call it with the chats and either precomputed ``teacher_log_probs`` (one 1-D tensor per
    chat, as from :func:`teacher_chat_logprobs`) or a ``teacher`` given at construction.
    Masks come from the chat template unless ``assistant_masks`` / ``attention_masks`` are given.
    """

    def __init__(
        self,
        student: nn.Module,
        tokenizer,
        *,
        teacher: nn.Module | None = None,
        kl_direction: KLDirection = "reverse",
        reduction: Reduction = "mean",
        normalize_by_seq_length: bool = True,
        assistant_only: bool = True,
        chat_template: str | None = None,
    ):
        super().__init__()
        if kl_direction not in ("reverse", "forward"):
            raise ValueError(f"kl_direction must be 'reverse' or 'forward', got {kl_direction!r}")
        if reduction not in ("mean", "sum", "none"):
            raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
        self.student = student
        self.teacher = teacher
        self.tokenizer = tokenizer
        self.kl_direction = kl_direction
        self.reduction = reduction
        self.normalize_by_seq_length = normalize_by_seq_length
        self.assistant_only = assistant_only
        self.chat_template = chat_template

    def forward(
        self,
        chats: Sequence[Sequence[dict]],
        teacher_log_probs: Sequence[torch.Tensor] | None = None,
        *,
        assistant_masks: Sequence[torch.Tensor] | None = None,
        attention_masks: Sequence[torch.Tensor] | None = None,
    ) -> DistillationOutput:
        """The loss for a batch of chats; gradients reach the student only."""
        tokens = tokenize_chats(self.tokenizer, chats, self.chat_template)
        assistant = (
            [m.bool() for m in assistant_masks]
            if assistant_masks is not None
            else tokens.assistant_mask
        )
        attention = (
            [m.bool() for m in attention_masks]
            if attention_masks is not None
            else tokens.attention_mask
        )
        scored = (
            [a & b for a, b in zip(assistant, attention, strict=True)]
            if self.assistant_only
            else attention
        )
        scored = [m.clone() for m in scored]
        for m in scored:
            m[0] = False  # nothing predicts the first token
        if teacher_log_probs is None and self.teacher is not None:
            with torch.no_grad():
                teacher_log_probs = _score(
                    self.teacher, tokens.input_ids, scored, self.tokenizer.pad_token_id or 0
                )
        student_log_probs = _score(
            self.student, tokens.input_ids, scored, self.tokenizer.pad_token_id or 0
        )
        return distillation_loss(
            student_log_probs,
            teacher_log_probs,
            scored,
            kl_direction=self.kl_direction,
            reduction=self.reduction,
            normalize_by_seq_length=self.normalize_by_seq_length,
            assistant_mask=assistant,
            assistant_only=self.assistant_only,
        )
