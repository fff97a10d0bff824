"""One batch's update: ``num_substeps`` optimizer steps, each with gradient accumulation."""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, replace
from itertools import pairwise

import torch
from torch import nn

from opd.config import TrainingConfig
from opd.logprobs import (
    LogitTransform,
    backbone_and_head,
    logit_transform_for,
    scatter_rows,
    scored_hidden_states,
    sequence_logprobs,
)
from opd.losses import k3_kl_token_estimate
from opd.models import DTYPES
from opd.objectives.jsd_head import chunked_jsd
from opd.objectives.policy_losses import POLICY_LOSSES, aggregate
from opd.objectives.topk_head import chunked_topk_forward_kl
from opd.trainer.rollouts import RolloutBatch


@dataclass
class TeacherTargets:
    """The teacher's side of a batch, laid out like the batch: position t is about token t.

    ``logprobs_BT`` always; ``topk_*_BTK`` for ``topk_forward_kl``; ``hidden_BTD`` with the
    teacher's lm head and logit transform for ``jsd``.
    """

    logprobs_BT: torch.Tensor
    topk_ids_BTK: torch.Tensor | None = None
    topk_logprobs_BTK: torch.Tensor | None = None
    hidden_BTD: torch.Tensor | None = None
    head: nn.Linear | None = None
    transform: LogitTransform | None = None

    def select(self, rows: slice) -> TeacherTargets:
        """The same contiguous rows as :meth:`RolloutBatch.select`."""

        def cut(tensor):
            return None if tensor is None else tensor[rows]

        return replace(
            self,
            logprobs_BT=self.logprobs_BT[rows],
            topk_ids_BTK=cut(self.topk_ids_BTK),
            topk_logprobs_BTK=cut(self.topk_logprobs_BTK),
            hidden_BTD=cut(self.hidden_BTD),
        )


@dataclass
class UpdateStats:
    """What the update measured on the batch, for the step's metrics."""

    loss: float
    objective_value: float
    entropy: float
    kl_sample_train: float
    grad_norm: float
    applied_substeps: int


def contiguous_slices(total: int, parts: int) -> list[slice]:
    """``parts`` near-equal contiguous slices of ``range(total)`` (empty ones dropped)."""
    bounds = [round(i * total / parts) for i in range(parts + 1)]
    return [slice(a, b) for a, b in pairwise(bounds) if b > a]


def objective_per_token(
    model,
    piece: RolloutBatch,
    teacher: TeacherTargets | None,
    advantages_BT: torch.Tensor,
    training: TrainingConfig,
    vocab_size: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token loss (B, T) of ``training.objective``, and the student's log-probs and entropy."""
    device = next(model.parameters()).device
    ids, attention, mask = (
        t.to(device) for t in (piece.input_ids_BT, piece.attention_mask_BT, piece.mask_BT)
    )
    objective = training.objective
    autocast_dtype = DTYPES.get(training.autocast)
    if objective in ("jsd", "topk_forward_kl"):
        hidden_ND, token_ids_N, selected_BT = scored_hidden_states(
            model, ids, attention, mask, autocast_dtype=autocast_dtype
        )
        scored = mask.bool()
        head = backbone_and_head(model)[1]
        transform = logit_transform_for(model, training.temperature)
        if objective == "jsd":
            loss_N, logprobs_N, entropy_N = chunked_jsd(
                hidden_ND,
                head,
                token_ids_N,
                teacher.hidden_BTD.to(device)[scored],
                teacher.head,
                training.beta,
                chunk_size=training.logprob_chunk_size,
                transform=transform,
                teacher_transform=teacher.transform,
                vocab_size=vocab_size,
            )
        else:
            loss_N, logprobs_N, entropy_N = chunked_topk_forward_kl(
                hidden_ND,
                head,
                token_ids_N,
                teacher.topk_ids_BTK.to(device)[scored],
                teacher.topk_logprobs_BTK.to(device)[scored],
                chunk_size=training.logprob_chunk_size,
                transform=transform,
                vocab_size=vocab_size,
            )
        return (
            scatter_rows(loss_N, selected_BT),
            scatter_rows(logprobs_N, selected_BT),
            scatter_rows(entropy_N, selected_BT),
        )
    logprobs, entropy = sequence_logprobs(
        model,
        ids,
        attention,
        mask,
        temperature=training.temperature,
        chunk_size=training.logprob_chunk_size,
        vocab_size=vocab_size,
        autocast_dtype=autocast_dtype,
    )
    if objective == "sampled_reverse_kl":
        sampled = piece.sampled_logprobs_BT.to(device)
        per_token = POLICY_LOSSES[training.loss_fn](
            logprobs, sampled, advantages_BT.to(device), training.loss_fn_config
        )
    elif objective == "k3":
        teacher_logprobs = teacher.logprobs_BT.to(device)
        if training.kl_direction == "reverse":
            per_token = k3_kl_token_estimate(teacher_logprobs, logprobs)
        else:
            per_token = k3_kl_token_estimate(logprobs, teacher_logprobs)
    else:
        per_token = -logprobs
    return per_token, logprobs, entropy


def policy_update(
    model,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    batch: RolloutBatch,
    teacher: TeacherTargets | None,
    advantages_BT: torch.Tensor,
    training: TrainingConfig,
    vocab_size: int,
) -> UpdateStats:
    """Split the batch into substeps; per substep accumulate micro-batch gradients, clip, step.

    A substep whose gradient is not finite is skipped (weights untouched) with a warning.
    Gradients are freed once used, so sampling and scoring the next batch run without them.
    """
    device = next(model.parameters()).device
    parameters = [p for p in model.parameters() if p.requires_grad]
    totals = {"loss": 0.0, "objective": 0.0, "entropy": 0.0, "kl": 0.0, "tokens": 0.0, "grad_norm": 0.0}
    applied = 0
    model.train()
    for substep in contiguous_slices(len(batch.prompt_lengths), training.num_substeps):
        part, part_teacher, part_advantages = (
            batch.select(substep),
            None if teacher is None else teacher.select(substep),
            advantages_BT[substep],
        )
        num_tokens = int(part.mask_BT.sum())
        num_sequences = part.mask_BT.shape[0]
        micro = training.micro_batch_size or num_sequences
        for rows in contiguous_slices(num_sequences, math.ceil(num_sequences / micro)):
            piece = part.select(rows)
            mask = piece.mask_BT.to(device)
            per_token, logprobs, entropy = objective_per_token(
                model,
                piece,
                None if part_teacher is None else part_teacher.select(rows),
                part_advantages[rows],
                training,
                vocab_size,
            )
            loss = aggregate(per_token, mask, training.loss_aggregation, num_tokens, num_sequences)
            loss.backward()
            totals["loss"] += float(loss.detach())
            totals["objective"] += float((per_token.detach() * mask).sum())
            totals["entropy"] += float((entropy * mask).sum())
            totals["kl"] += float(((piece.sampled_logprobs_BT.to(device) - logprobs.detach()) * mask).sum())
            totals["tokens"] += float(mask.sum())
        max_norm = training.max_grad_norm if training.max_grad_norm is not None else math.inf
        grad_norm = float(torch.nn.utils.clip_grad_norm_(parameters, max_norm))
        if not math.isfinite(grad_norm):
            warnings.warn("non-finite gradient: skipping this optimizer step", stacklevel=2)
            optimizer.zero_grad(set_to_none=True)
            continue
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        totals["grad_norm"] += grad_norm
        applied += 1
    tokens = max(totals["tokens"], 1.0)
    return UpdateStats(
        loss=totals["loss"],
        objective_value=totals["objective"] / tokens,
        entropy=totals["entropy"] / tokens,
        kl_sample_train=totals["kl"] / tokens,
        grad_norm=totals["grad_norm"] / max(applied, 1),
        applied_substeps=applied,
    )
