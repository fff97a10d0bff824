"""AdamW for the student, fused where torch has the kernel, float32 master weights for
half-precision ones, and its learning-rate schedule."""

from __future__ import annotations

import functools
import math

import torch

from opd.config import TrainingConfig

FUSED_DEVICE_TYPES = ("cpu", "cuda")


HALF = (torch.bfloat16, torch.float16)


class MasterWeightAdamW(torch.optim.AdamW):
    """AdamW that updates a float32 copy of each half-precision parameter, kept in its state.

    A bfloat16 weight has 8 bits of mantissa: an Adam step of 3e-5 on a weight of 0.03 is a
    thousandth of it, under half its rounding step, so in pure bfloat16 most weights never move
    (measured: 88% of a layer's weights unchanged after 10 steps at 3e-5). Here the step runs on
    a float32 copy (``state["master"]``, the moments in float32 beside it: AdamW's update rule,
    written out so that it works on FSDP's sharded parameters too) and the parameter gets it
    rounded. The copy is saved and loaded with the rest of the optimizer's state, so a resumed run
    goes on from the same float32 weights. Float32 parameters are updated by AdamW itself.
    """

    @torch.no_grad()
    def step(self, closure=None):
        half = []
        for group in self.param_groups:
            for parameter in group["params"]:
                if parameter.grad is not None and parameter.dtype in HALF:
                    half.append((group, parameter, parameter.grad))
                    parameter.grad = None  # hidden from AdamW's own step
        try:
            loss = super().step(closure)
        finally:
            for _, parameter, grad in half:
                parameter.grad = grad
        for group, parameter, grad in half:
            self._master_step(group, parameter, grad.float())
        return loss

    def load_state_dict(self, state_dict: dict) -> None:
        """AdamW's, but a half-precision parameter's master copy and moments stay float32 (torch
        casts every floating state to its parameter's dtype)."""
        ids = [index for group in state_dict["param_groups"] for index in group["params"]]
        parameters = [parameter for group in self.param_groups for parameter in group["params"]]
        kept = {
            parameter: {
                key: value for key, value in state_dict["state"][index].items() if key != "step"
            }
            for index, parameter in zip(ids, parameters, strict=True)
            if parameter.dtype in HALF and "master" in state_dict["state"].get(index, {})
        }
        super().load_state_dict(state_dict)
        for parameter, values in kept.items():
            for key, value in values.items():
                self.state[parameter][key] = value.to(
                    device=parameter.device, dtype=torch.float32
                ).clone()

    def _master_step(self, group: dict, parameter: torch.Tensor, grad: torch.Tensor) -> None:
        state = self.state[parameter]
        if "master" not in state:
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = torch.zeros_like(parameter, dtype=torch.float32)
            state["exp_avg_sq"] = torch.zeros_like(parameter, dtype=torch.float32)
            state["master"] = parameter.detach().float()
        beta1, beta2 = group["betas"]
        lr, master = group["lr"], state["master"]
        state["step"] += 1
        step = state["step"].item()
        master.mul_(1 - lr * group["weight_decay"])
        state["exp_avg"].lerp_(grad, 1 - beta1)
        state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        denom = (state["exp_avg_sq"].sqrt() / math.sqrt(1 - beta2**step)).add_(group["eps"])
        master.addcdiv_(state["exp_avg"], denom, value=-lr / (1 - beta1**step))
        parameter.copy_(master)


def adamw(
    parameters: list[torch.nn.Parameter],
    *,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float = 0.0,
) -> torch.optim.AdamW:
    """AdamW; the fused kernel (one pass over each tensor, not ~10 elementwise ops) when every
    parameter is a floating tensor on a CPU or CUDA device: the same update rule, other rounding.
    Half-precision parameters are updated through float32 master weights
    (:class:`MasterWeightAdamW`)."""
    fused = bool(parameters) and all(
        p.device.type in FUSED_DEVICE_TYPES and p.dtype.is_floating_point for p in parameters
    )
    kind = MasterWeightAdamW if any(p.dtype in HALF for p in parameters) else torch.optim.AdamW
    return kind(
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
        lr_factor,
        warmup_steps=training.warmup_steps,
        total_steps=total_steps,
        schedule=training.lr_schedule,
    )
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
