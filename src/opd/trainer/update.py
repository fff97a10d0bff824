"""One batch's policy update: ``num_substeps`` optimizer steps, each with gradient accumulation."""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from itertools import pairwise

import torch

from opd.config import TrainingConfig
from opd.logprobs import sequence_logprobs
from opd.objectives.policy_losses import POLICY_LOSSES, aggregate
from opd.trainer.rollouts import RolloutBatch


@dataclass
class UpdateStats:
    """What the update measured on the batch, for the step's metrics."""

    loss: float
    entropy: float
    kl_sample_train: float
    grad_norm: float
    applied_substeps: int


def contiguous_slices(total: int, parts: int) -> list[slice]:
    """``parts`` near-equal contiguous slices of ``range(total)`` (empty ones dropped)."""
    bounds = [round(i * total / parts) for i in range(parts + 1)]
    return [slice(a, b) for a, b in pairwise(bounds) if b > a]


def policy_update(
    model,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    batch: RolloutBatch,
    advantages_BT: torch.Tensor,
    training: TrainingConfig,
    vocab_size: int,
) -> UpdateStats:
    """Split the batch into substeps; per substep accumulate micro-batch gradients, clip, step.

    A substep whose gradient is not finite is skipped (weights untouched) with a warning.
    """
    loss_fn = POLICY_LOSSES[training.loss_fn]
    device = next(model.parameters()).device
    parameters = [p for p in model.parameters() if p.requires_grad]
    totals = {"loss": 0.0, "entropy": 0.0, "kl": 0.0, "tokens": 0.0, "grad_norm": 0.0}
    applied = 0
    model.train()
    for substep in contiguous_slices(len(batch.prompt_lengths), training.num_substeps):
        part = batch.select(substep)
        part_advantages = advantages_BT[substep]
        num_tokens = int(part.mask_BT.sum())
        num_sequences = part.mask_BT.shape[0]
        micro = training.micro_batch_size or num_sequences
        optimizer.zero_grad(set_to_none=True)
        for rows in contiguous_slices(num_sequences, math.ceil(num_sequences / micro)):
            piece = part.select(rows)
            mask = piece.mask_BT.to(device)
            logprobs, entropy = sequence_logprobs(
                model,
                piece.input_ids_BT.to(device),
                piece.attention_mask_BT.to(device),
                mask,
                temperature=training.temperature,
                chunk_size=training.logprob_chunk_size,
                vocab_size=vocab_size,
            )
            sampled = piece.sampled_logprobs_BT.to(device)
            per_token = loss_fn(logprobs, sampled, part_advantages[rows].to(device), training.loss_fn_config)
            loss = aggregate(per_token, mask, training.loss_aggregation, num_tokens, num_sequences)
            loss.backward()
            totals["loss"] += float(loss.detach())
            totals["entropy"] += float((entropy * mask).sum())
            totals["kl"] += float(((sampled - logprobs.detach()) * mask).sum())
            totals["tokens"] += float(mask.sum())
        max_norm = training.max_grad_norm if training.max_grad_norm is not None else math.inf
        grad_norm = float(torch.nn.utils.clip_grad_norm_(parameters, max_norm))
        if not math.isfinite(grad_norm):
            warnings.warn("non-finite gradient: skipping this optimizer step", stacklevel=2)
            optimizer.zero_grad(set_to_none=True)
            continue
        optimizer.step()
        scheduler.step()
        totals["grad_norm"] += grad_norm
        applied += 1
    tokens = max(totals["tokens"], 1.0)
    return UpdateStats(
        loss=totals["loss"],
        entropy=totals["entropy"] / tokens,
        kl_sample_train=totals["kl"] / tokens,
        grad_norm=totals["grad_norm"] / max(applied, 1),
        applied_substeps=applied,
    )
