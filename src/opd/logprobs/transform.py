"""Logits as the model's own forward makes them (``logit_scale``, ``logits_scaling``,
``final_logit_softcapping``), then a sampling temperature, sliced to the tokenizer's vocabulary,
one chunk of rows at a time."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class LogitTransform:
    """How raw lm-head outputs become the logits a distribution is taken over.

    ``z = softcap * tanh(scale * raw / softcap) / temperature`` (no tanh when ``softcap`` is None).
    """

    scale: float = 1.0
    softcap: float | None = None
    temperature: float = 1.0

    def apply(self, raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | float]:
        """Return the transformed logits and dz/draw (a tensor, or a constant).

        Without a softcap the logits are scaled once, and not at all by a factor of 1 (each
        pass over a chunk x V block costs as much as a small matmul on a CPU).
        """
        if self.softcap is None:
            factor = self.scale / self.temperature
            return (raw if factor == 1.0 else raw * factor), factor
        squashed = torch.tanh(raw * self.scale / self.softcap)
        derivative = (1.0 - squashed.square()) * (self.scale / self.temperature)
        return squashed * (self.softcap / self.temperature), derivative


PLAIN_LOGITS = LogitTransform()
"""No scaling, no softcap, temperature 1."""


def logit_transform_for(model: nn.Module, temperature: float = 1.0) -> LogitTransform:
    """Read the logit scaling a Hugging Face model applies in its own forward."""
    config = (
        model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    )
    scale = float(getattr(config, "logit_scale", None) or 1.0)
    logits_scaling = getattr(config, "logits_scaling", None)
    if logits_scaling:
        scale /= float(logits_scaling)
    softcap = getattr(config, "final_logit_softcapping", None)
    return LogitTransform(
        scale=scale, softcap=float(softcap) if softcap else None, temperature=temperature
    )


def head_weights(
    lm_head: nn.Linear, vocab_size: int | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The lm head's weight and bias, cut to the first ``vocab_size`` rows (the tokenizer's ids)."""
    weight, bias = lm_head.weight, lm_head.bias
    if vocab_size is not None and vocab_size < weight.shape[0]:
        weight = weight[:vocab_size]
        bias = bias[:vocab_size] if bias is not None else None
    return weight, bias


def chunk_logits(
    hidden_chunk: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    transform: LogitTransform,
) -> tuple[torch.Tensor, torch.Tensor | float]:
    raw = hidden_chunk @ weight.T
    if bias is not None:
        raw = raw + bias
    return transform.apply(raw.float())


def chunk_logits_inplace(
    hidden_chunk: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    transform: LogitTransform,
) -> torch.Tensor:
    """Transformed float32 logits of a chunk in one buffer (no derivative kept)."""
    logits = (hidden_chunk @ weight.T).float()
    if bias is not None:
        logits += bias
    if transform.softcap is not None:
        return transform.apply(logits)[0]
    factor = transform.scale / transform.temperature
    if factor != 1.0:
        logits *= factor
    return logits


def row_dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``(a * b).sum(-1)`` without the product's ``chunk x V`` buffer."""
    return (a.unsqueeze(-2) @ b.unsqueeze(-1)).view(-1)


def refuse_ids_outside(ids: torch.Tensor, vocab_size: int, what: str) -> None:
    """A clear error for an id past the head's rows, instead of an index error inside a gather."""
    if ids.numel() and int(ids.max()) >= vocab_size:
        raise ValueError(
            f"{what} {int(ids.max())} is outside the model's vocabulary of {vocab_size}"
        )
