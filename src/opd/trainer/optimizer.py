"""AdamW for the student, fused where torch has the kernel, and its learning-rate schedule."""

from __future__ import annotations

import functools
import math

import torch

from opd.config import TrainingConfig

FUSED_DEVICE_TYPES = ("cpu", "cuda")


def adamw(
    parameters: list[torch.nn.Parameter],
    *,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float = 0.0,
) -> torch.optim.AdamW:
    """AdamW; the fused kernel (one pass over each tensor, not ~10 elementwise ops) when every
    parameter is a floating tensor on a CPU or CUDA device: the same update rule, other rounding."""
    fused = bool(parameters) and all(
        p.device.type in FUSED_DEVICE_TYPES and p.dtype.is_floating_point for p in parameters
    )
    return torch.optim.AdamW(
        parameters, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, fused=fused or None
    )


def lr_factor(optimizer_step: int, *, warmup_steps: int, total_steps: int, schedule: str) -> float:
    """The fraction of the peak learning rate used by optimizer step ``optimizer_step`` (from 0).

    Warmup reaches the peak at its last step; a decay reaches 0 one step after the last, so no
    step is spent at a learning rate of 0.
    """
    if optimizer_step < warmup_steps:
        return (optimizer_step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (optimizer_step - warmup_steps) / max(1, total_steps - warmup_steps))
    if schedule == "linear":
        return 1.0 - progress
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def build_optimizer(
    parameters: list[torch.nn.Parameter], training: TrainingConfig, total_steps: int
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW with the reference's betas and the configured warmup and decay over ``total_steps``
    optimizer steps."""
    optimizer = adamw(
        parameters,
        lr=training.learning_rate,
        betas=(training.adam_beta1, training.adam_beta2),
        eps=training.adam_eps,
        weight_decay=training.weight_decay,
    )
    schedule = functools.partial(
        lr_factor, warmup_steps=training.warmup_steps, total_steps=total_steps, schedule=training.lr_schedule
    )
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
