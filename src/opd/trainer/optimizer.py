"""AdamW for the student, fused where torch has the kernel, and its learning-rate schedule."""

from __future__ import annotations

import torch

from opd.config import Config

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
    parameter is a floating tensor on a CPU or CUDA device. On CPU it steps a 135M-parameter
    model about 5x faster than the default loop; same update rule, other rounding."""
    fused = bool(parameters) and all(
        p.device.type in FUSED_DEVICE_TYPES and p.dtype.is_floating_point for p in parameters
    )
    return torch.optim.AdamW(
        parameters, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, fused=fused or None
    )


def build_optimizer(model, config: Config) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW with the reference's betas; constant LR after a linear warmup."""
    training = config.training
    optimizer = adamw(
        [p for p in model.parameters() if p.requires_grad],
        lr=training.learning_rate,
        betas=(training.adam_beta1, training.adam_beta2),
        eps=training.adam_eps,
        weight_decay=training.weight_decay,
    )
    warmup = training.warmup_steps

    def lr_factor(optimizer_step: int) -> float:
        return min(1.0, (optimizer_step + 1) / warmup) if warmup > 0 else 1.0

    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
