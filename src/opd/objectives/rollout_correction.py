"""Rollout correction: the policy loss when the sampler and the trainer disagree on a token's
probability (vLLM in bfloat16 against a float32 trainer, other kernels, a server's weights a
sync behind).

Uncorrected, a policy-gradient loss weighs each sampled token by ``rho = p_trainer / p_sampler``;
the sampler's rare tokens that the trainer finds likely get weights of 10 or 1000, and a run
drifts. Corrected, the loss is taken as if on-policy for the trainer (its own log-probs, held
constant, as the ratio's denominator) and each token's loss is multiplied by a weight of
``rho`` that stays bounded:

- ``truncate`` (truncated importance sampling, TIS): ``min(rho, cap)``;
- ``mask``: 1 where ``1/cap <= rho <= cap``, else 0: the token leaves the loss.

At ``level: sequence`` every token of a completion takes its completion's ``rho``: the geometric
mean of its tokens' ratios, ``exp(mean log rho)``, whose scale does not grow with the length.
Matched sampler and trainer (``rho`` = 1 within float noise) train exactly as uncorrected.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

import torch


@dataclass(frozen=True)
class RolloutCorrection:
    """``training.rollout_correction``: bound the weight of sampled tokens the sampler and the
    trainer disagree on (objectives whose loss reads the sampler's log-probs)."""

    mode: Literal["truncate", "mask"] = "truncate"
    """``truncate``: each weight capped at ``cap``; ``mask``: tokens (or completions) whose ratio
    lies outside ``[1/cap, cap]`` dropped from the loss."""
    level: Literal["token", "sequence"] = "token"
    """``token``: each token's own ratio; ``sequence``: each completion's (the geometric mean of
    its tokens' ratios) for all its tokens."""
    cap: float = 2.0
    """The largest ratio ``p_trainer / p_sampler`` kept as it is (> 1)."""

    def problems(self) -> Iterator[tuple[str, str]]:
        if not self.cap > 1.0:
            yield "cap", f"must be > 1 (a ratio of probabilities; 2 is usual), got {self.cap}"

    def ratios(
        self, logprobs_N: torch.Tensor, sampler_logprobs_N: torch.Tensor, sequence_N: torch.Tensor
    ) -> torch.Tensor:
        """``p_trainer / p_sampler`` of each token, or of its completion (held constant)."""
        log_ratio_N = (logprobs_N.detach() - sampler_logprobs_N).float()
        if self.level == "token":
            return log_ratio_N.exp()
        count = int(sequence_N.max()) + 1 if sequence_N.numel() else 0
        sums = torch.zeros(count, device=log_ratio_N.device).index_add_(0, sequence_N, log_ratio_N)
        tokens = torch.zeros(count, device=log_ratio_N.device).index_add_(
            0, sequence_N, torch.ones_like(log_ratio_N)
        )
        return (sums / tokens.clamp(min=1))[sequence_N].exp()

    def weights(self, ratio_N: torch.Tensor) -> torch.Tensor:
        """Each token's weight in the loss, from its ratio."""
        if self.mode == "truncate":
            return ratio_N.clamp(max=self.cap)
        return ((ratio_N >= 1.0 / self.cap) & (ratio_N <= self.cap)).to(ratio_N.dtype)

    def bounded(self, ratio_N: torch.Tensor) -> torch.Tensor:
        """Which tokens the correction changed: capped (truncate) or dropped (mask)."""
        if self.mode == "truncate":
            return ratio_N > self.cap
        return (ratio_N < 1.0 / self.cap) | (ratio_N > self.cap)


def correction_sums(
    correction: RolloutCorrection,
    logprobs_BT: torch.Tensor,
    sampler_logprobs_BT: torch.Tensor,
    mask_BT: torch.Tensor,
) -> list[float]:
    """Sums over a micro-batch's completion tokens, for the step's ``rollout_correction/``
    metrics: the mismatch KL(sampler || trainer) (k3: ``rho - 1 - log rho``, never negative),
    the weights, the tokens bounded, and the largest weight."""
    kept = mask_BT.bool()
    rows = torch.arange(mask_BT.shape[0], device=mask_BT.device)[:, None].expand_as(mask_BT)
    logprobs_N, sampler_N = (
        logprobs_BT.detach()[kept],
        sampler_logprobs_BT.to(logprobs_BT.device)[kept],
    )
    token_ratio_N = (logprobs_N - sampler_N).float().exp()
    ratio_N = correction.ratios(logprobs_N, sampler_N, rows[kept])
    weight_N = correction.weights(ratio_N)
    return [
        float((token_ratio_N - 1 - token_ratio_N.log()).sum()),
        float(weight_N.sum()),
        float(correction.bounded(ratio_N).sum()),
        float(weight_N.max()) if weight_N.numel() else 0.0,
    ]
