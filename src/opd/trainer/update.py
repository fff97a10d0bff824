"""One batch's update: ``num_substeps`` optimizer steps, each with gradient accumulation."""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import torch

from opd.assemble.micro_batching import MicroBatching
from opd.config import TrainingConfig
from opd.data.batching import contiguous_slices
from opd.data.sequences import RolloutBatch
from opd.distributed import all_reduce, world
from opd.logprobs import flat_rows, scatter_rows
from opd.models import DTYPES
from opd.objectives.base import Objective, StudentRows, TargetRows
from opd.objectives.policy_losses import PolicyGradient, aggregate
from opd.objectives.rollout_correction import correction_sums
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
    correction: dict[str, float]
    """``rollout_correction/*`` metrics (empty without a correction)."""


def policy_gradient(training: TrainingConfig) -> PolicyGradient:
    """The policy-gradient settings of the run, as objectives with advantages read them."""
    return PolicyGradient(
        training.loss_fn,
        training.loss_fn_config,
        training.kl_penalty_coef,
        training.kl_discount_factor,
        training.advantage_clip,
        training.correction,
    )


def token_losses(
    policy: Policy,
    objective: Objective,
    piece: RolloutBatch,
    teacher: TeacherScores | None,
    advantages_BT: torch.Tensor,
    training: TrainingConfig,
    *,
    reward_in_loss: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token loss (B, T) of ``objective``, and the student's log-probs and entropy, in one
    forward.

    ``reward_in_loss``: ``advantages_BT`` are the task's reward term for an objective without
    advantages, added to its loss as ``training.loss_fn`` on the sampled tokens (a policy gradient
    whose log-probs are differentiable: taken again when the objective's are not, as the fused
    ``jsd`` and ``topk`` heads' are not)."""
    mask = piece.mask_BT
    device = policy.device
    targets = TargetRows(
        flat_rows(piece.sampled_logprobs_BT, mask).to(device),
        flat_rows(advantages_BT, mask).to(device),
        None if teacher is None else teacher.rows(mask, device),
        policy_gradient(training),
        flat_rows(torch.arange(mask.shape[0])[:, None].expand_as(mask), mask).to(device),
    )
    transform = policy.logit_transform(training.temperature)

    def losses(hidden_ND, token_ids_N, head):
        student = StudentRows(
            hidden_ND, token_ids_N, head, transform, policy.vocab_size, training.logprob_chunk_size
        )
        rows = objective.token_losses(student, targets)
        if reward_in_loss:
            logprobs_N = rows.logprobs_N if rows.logprobs_N.requires_grad else student.logprobs()[0]
            rows.loss_N = rows.loss_N + targets.policy_loss(logprobs_N)
        return rows

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
    batching: MicroBatching,
    *,
    reward_in_loss: bool = False,
) -> UpdateStats:
    """Split the batch into substeps; per substep accumulate the gradients of its micro-batches
    (``batching``), clip, step.

    A substep whose gradient is not finite is skipped (weights untouched) with a warning.
    Gradients are freed once used, so sampling and scoring the next batch run without them.
    Every optimizer step taken advances the policy's version.

    Among several processes ``batch`` is this process's share: the token and sequence counts
    that normalise the loss are the whole batch's (summed over processes), and each process's
    loss is scaled by their number because DDP and FSDP average gradients, so N processes make
    the update one process makes on the whole batch. The statistics returned are the whole batch's.
    ``reward_in_loss``: as :func:`token_losses` takes it.
    """
    device = policy.device
    processes = world().size
    parameters = policy.trainable_parameters()
    totals = {"loss": 0.0, "objective": 0.0, "entropy": 0.0, "kl": 0.0, "tokens": 0.0}
    correction, corrected, most_weight = training.correction, [0.0, 0.0, 0.0], 0.0
    grad_norms = 0.0
    applied = 0
    policy.train()
    for substep in contiguous_slices(len(batch.prompt_lengths), training.num_substeps):
        part, part_teacher, part_advantages = (
            batch.select(substep),
            None if teacher is None else teacher.select(substep),
            advantages_BT[substep],
        )
        num_tokens, num_sequences = (
            int(count)
            for count in all_reduce([float(part.mask_BT.sum()), float(part.mask_BT.shape[0])])
        )
        pieces = batching.split(part)
        for index, rows in enumerate(pieces):
            piece = part.select(rows)
            mask = piece.mask_BT.to(device)
            with policy.gradient_sync(index == len(pieces) - 1):
                per_token, logprobs, entropy = token_losses(
                    policy,
                    objective,
                    piece,
                    None if part_teacher is None else part_teacher.select(rows),
                    part_advantages[rows],
                    training,
                    reward_in_loss=reward_in_loss,
                )
                loss = aggregate(
                    per_token, mask, training.loss_aggregation, num_tokens, num_sequences
                )
                (loss * processes if processes > 1 else loss).backward()
            totals["loss"] += float(loss.detach())
            totals["objective"] += float((per_token.detach() * mask).sum())
            totals["entropy"] += float((entropy * mask).sum())
            totals["kl"] += float(
                ((piece.sampled_logprobs_BT.to(device) - logprobs.detach()) * mask).sum()
            )
            totals["tokens"] += float(mask.sum())
            if correction is not None:
                *sums, largest = correction_sums(
                    correction, logprobs, piece.sampled_logprobs_BT, mask
                )
                corrected = [a + b for a, b in zip(corrected, sums, strict=True)]
                most_weight = max(most_weight, largest)
        max_norm = training.max_grad_norm if training.max_grad_norm is not None else math.inf
        grad_norm = whole_norm(torch.nn.utils.clip_grad_norm_(parameters, max_norm))
        if not math.isfinite(grad_norm):
            warnings.warn("non-finite gradient: skipping this optimizer step", stacklevel=2)
            optimizer.zero_grad(set_to_none=True)
            continue
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        policy.version += 1
        grad_norms += grad_norm
        applied += 1
    loss, objective_sum, entropy_sum, kl_sum, tokens = all_reduce(list(totals.values()))
    tokens = max(tokens, 1.0)
    correction_metrics = {}
    if correction is not None:
        mismatch, weights, bounded = all_reduce(corrected)
        correction_metrics = {
            "rollout_correction/mismatch_kl": mismatch / tokens,
            "rollout_correction/weight_mean": weights / tokens,
            "rollout_correction/weight_max": all_reduce([most_weight], op="max")[0],
            f"rollout_correction/{'capped' if correction.mode == 'truncate' else 'masked'}_frac": (
                bounded / tokens
            ),
        }
    return UpdateStats(
        loss=loss,
        objective_value=objective_sum / tokens,
        entropy=entropy_sum / tokens,
        kl_sample_train=kl_sum / tokens,
        grad_norm=grad_norms / max(applied, 1),
        applied_substeps=applied,
        correction=correction_metrics,
    )


def whole_norm(norm: torch.Tensor) -> float:
    """The gradient norm over every process's shard (a sharded norm is a DTensor)."""
    return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
