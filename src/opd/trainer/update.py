"""One batch's update: ``num_substeps`` optimizer steps, each with gradient accumulation."""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from itertools import pairwise

import torch

from opd.config import TrainingConfig
from opd.data.sequences import RolloutBatch
from opd.logprobs import flat_rows, scatter_rows
from opd.models import DTYPES
from opd.objectives.base import Objective, StudentRows, TargetRows
from opd.objectives.policy_losses import PolicyGradient, aggregate
from opd.policy.policy import Policy
from opd.teachers.base import TeacherScores


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


def policy_gradient(training: TrainingConfig) -> PolicyGradient:
    """The policy-gradient settings of the run, as objectives with advantages read them."""
    return PolicyGradient(
        training.loss_fn, training.loss_fn_config, training.kl_penalty_coef, training.kl_discount_factor
    )


def token_losses(
    policy: Policy,
    objective: Objective,
    piece: RolloutBatch,
    teacher: TeacherScores | None,
    advantages_BT: torch.Tensor,
    training: TrainingConfig,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token loss (B, T) of ``objective``, and the student's log-probs and entropy, in one forward."""
    mask = piece.mask_BT
    device = policy.device
    targets = TargetRows(
        flat_rows(piece.sampled_logprobs_BT, mask).to(device),
        flat_rows(advantages_BT, mask).to(device),
        None if teacher is None else teacher.rows(mask, device),
        policy_gradient(training),
    )
    transform = policy.logit_transform(training.temperature)

    def losses(hidden_ND, token_ids_N, head):
        student = StudentRows(
            hidden_ND, token_ids_N, head, transform, policy.vocab_size, training.logprob_chunk_size
        )
        return objective.token_losses(student, targets)

    rows, selected_BT = policy.forward_rows(
        piece.input_ids_BT,
        piece.attention_mask_BT,
        mask,
        losses,
        autocast_dtype=DTYPES.get(training.autocast),
    )
    return (
        scatter_rows(rows.loss_N, selected_BT),
        scatter_rows(rows.logprobs_N, selected_BT),
        scatter_rows(rows.entropy_N, selected_BT),
    )


def policy_update(
    policy: Policy,
    objective: Objective,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    batch: RolloutBatch,
    teacher: TeacherScores | None,
    advantages_BT: torch.Tensor,
    training: TrainingConfig,
) -> UpdateStats:
    """Split the batch into substeps; per substep accumulate micro-batch gradients, clip, step.

    A substep whose gradient is not finite is skipped (weights untouched) with a warning.
    Gradients are freed once used, so sampling and scoring the next batch run without them.
    Every optimizer step taken advances the policy's version.
    """
    device = policy.device
    parameters = policy.trainable_parameters()
    totals = {"loss": 0.0, "objective": 0.0, "entropy": 0.0, "kl": 0.0, "tokens": 0.0, "grad_norm": 0.0}
    applied = 0
    policy.train()
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
            per_token, logprobs, entropy = token_losses(
                policy,
                objective,
                piece,
                None if part_teacher is None else part_teacher.select(rows),
                part_advantages[rows],
                training,
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
        policy.version += 1
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
