"""Policy-gradient losses on sampled tokens, as in the reference recipe.

Each returns a per-token loss (B, T); :func:`aggregate` reduces it. ``r`` is the importance
ratio ``exp(logp_theta - logp_sampler)``, equal to 1 on the first substep of on-policy data.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from opd.objectives.rollout_correction import RolloutCorrection

LOSS_AGGREGATIONS = ("token_mean", "sequence_mean", "sum")


def importance_sampling(logp_BT, sampler_logp_BT, advantages_BT, config: Mapping) -> torch.Tensor:
    """``-r * A``: REINFORCE with an importance weight for off-policy substeps."""
    return -torch.exp(logp_BT - sampler_logp_BT) * advantages_BT


def ppo(logp_BT, sampler_logp_BT, advantages_BT, config: Mapping) -> torch.Tensor:
    """``-min(r * A, clip(r, low, high) * A)``: the clipped surrogate; bounds are ratio values."""
    ratio = torch.exp(logp_BT - sampler_logp_BT)
    clipped = ratio.clamp(
        config.get("clip_low_threshold", 0.8), config.get("clip_high_threshold", 1.2)
    )
    return -torch.minimum(ratio * advantages_BT, clipped * advantages_BT)


def cispo(logp_BT, sampler_logp_BT, advantages_BT, config: Mapping) -> torch.Tensor:
    """``-sg(clip(r, low, high)) * logp * A``: clipped weights, gradient through log-probs only."""
    ratio = torch.exp(logp_BT - sampler_logp_BT).detach()
    weight = ratio.clamp(
        config.get("clip_low_threshold", 0.8), config.get("clip_high_threshold", 1.2)
    )
    return -weight * logp_BT * advantages_BT


def dro(logp_BT, sampler_logp_BT, advantages_BT, config: Mapping) -> torch.Tensor:
    """``-(logp * A - beta/2 * (logp - logp_sampler)^2)``: a quadratic pull to the sampler."""
    beta = config.get("beta", 0.05)
    return -(logp_BT * advantages_BT - 0.5 * beta * (logp_BT - sampler_logp_BT).square())


POLICY_LOSSES: dict[str, Callable[..., torch.Tensor]] = {
    "importance_sampling": importance_sampling,
    "ppo": ppo,
    "cispo": cispo,
    "dro": dro,
}

LOSS_FN_CONFIG_KEYS = {
    "importance_sampling": set(),
    "ppo": {"clip_low_threshold", "clip_high_threshold"},
    "cispo": {"clip_low_threshold", "clip_high_threshold"},
    "dro": {"beta"},
}


@dataclass(frozen=True)
class PolicyGradient:
    """How per-token advantages are shaped and turned into a loss: the reference recipe's settings
    (``training.loss_fn``, ``training.loss_fn_config``, ``training.kl_penalty_coef``,
    ``training.kl_discount_factor``, ``training.advantage_clip``), for objectives that learn
    from advantages."""

    loss_fn: str = "importance_sampling"
    loss_fn_config: Mapping[str, float] = field(default_factory=dict)
    kl_penalty_coef: float = 1.0
    kl_discount_factor: float = 0.0
    advantage_clip: float | None = None
    correction: RolloutCorrection | None = None
    """``training.rollout_correction``: None takes the sampler's log-probs as they are."""

    def loss(
        self,
        logp: torch.Tensor,
        sampler_logp: torch.Tensor,
        advantages: torch.Tensor,
        sequence: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The per-token policy loss of ``loss_fn`` (flat rows; ``sequence``: each row's
        completion, read by a sequence-level correction). Corrected, the loss is taken against
        the trainer's own log-probs (held constant) and weighted by the bounded ratio
        (:mod:`opd.objectives.rollout_correction`)."""
        if self.correction is None:
            return POLICY_LOSSES[self.loss_fn](logp, sampler_logp, advantages, self.loss_fn_config)
        if sequence is None:
            sequence = torch.arange(logp.numel(), device=logp.device).view(logp.shape)
        weight = self.correction.weights(self.correction.ratios(logp, sampler_logp, sequence))
        loss = POLICY_LOSSES[self.loss_fn](logp, logp.detach(), advantages, self.loss_fn_config)
        return weight.to(loss.dtype) * loss


def aggregate(
    loss_BT: torch.Tensor, mask_BT: torch.Tensor, how: str, num_tokens: int, num_sequences: int
):
    """Reduce a per-token loss over a (micro-)batch that is part of a larger optimizer batch.

    ``num_tokens`` / ``num_sequences`` count the whole optimizer batch, so gradient
    accumulation over micro-batches gives the same gradient as one big batch.

    - ``sum``: sum over tokens (the reference recipe); the step size grows with batch and length.
    - ``token_mean``: sum / tokens in the batch; transfers across batch sizes (the default).
    - ``sequence_mean``: each sequence's token mean, averaged over sequences; short and long
      completions weigh the same.
    """
    masked = loss_BT * mask_BT
    if how == "sum":
        return masked.sum()
    if how == "token_mean":
        return masked.sum() / max(num_tokens, 1)
    if how == "sequence_mean":
        per_sequence = masked.sum(-1) / mask_BT.sum(-1).clamp(min=1)
        return per_sequence.sum() / max(num_sequences, 1)
    raise ValueError(f"unknown loss aggregation {how!r}; choose one of {LOSS_AGGREGATIONS}")
