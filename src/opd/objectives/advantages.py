"""Per-token advantages from the teacher's judgement of the student's own samples.

The student's sampled log-prob minus the teacher's log-prob of the same token is a
one-sample estimate of the reverse KL at that position; its negative is the reward.
"""

from __future__ import annotations

import torch


def reverse_kl_per_token(
    sampled_logprobs_BT: torch.Tensor, teacher_logprobs_BT: torch.Tensor, mask_BT: torch.Tensor
) -> torch.Tensor:
    """``(log p_student - log q_teacher) * mask``: the sampled-token reverse-KL estimate."""
    return (sampled_logprobs_BT - teacher_logprobs_BT) * mask_BT


def discounted_future_sum(values_BT: torch.Tensor, gamma: float) -> torch.Tensor:
    """``out_t = sum_k gamma^k values_{t+k}`` along the last dimension (a reverse scan)."""
    out_BT = torch.empty_like(values_BT)
    running = torch.zeros_like(values_BT[..., 0])
    for t in range(values_BT.shape[-1] - 1, -1, -1):
        running = values_BT[..., t] + gamma * running
        out_BT[..., t] = running
    return out_BT


def kl_advantages(
    sampled_logprobs_BT: torch.Tensor,
    teacher_logprobs_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    *,
    kl_penalty_coef: float,
    kl_discount_factor: float = 0.0,
    clip: float | None = None,
) -> torch.Tensor:
    """``-coef * mask * reverse_kl``, replaced by its discounted future sum when the factor is > 0,
    then clamped to ``[-clip, clip]`` when ``clip`` is set.

    With a discount, a token is also charged for the divergence of what it led to; the sum
    runs over completion positions only because the advantages are already masked.
    """
    advantages_BT = (
        -kl_penalty_coef
        * mask_BT
        * reverse_kl_per_token(sampled_logprobs_BT, teacher_logprobs_BT, mask_BT)
    )
    if kl_discount_factor > 0:
        advantages_BT = discounted_future_sum(advantages_BT, kl_discount_factor) * mask_BT
    if clip is not None:
        advantages_BT = advantages_BT.clamp(-clip, clip)
    return advantages_BT


def standardized(
    advantages_BT: torch.Tensor, mask_BT: torch.Tensor, mean: float, std: float
) -> torch.Tensor:
    """``(A - mean) / std`` on completion tokens, 0 elsewhere; ``mean`` and ``std`` are the whole
    batch's (every process's tokens), so how the batch is split does not change a token's value."""
    return (advantages_BT - mean) / max(std, 1e-8) * mask_BT


def group_centred_rewards(
    rewards_B: torch.Tensor, groups_B: torch.Tensor, *, std_normalization: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each sample's reward less the mean of its group's (the samples of one prompt), as the
    reference's ``compute_advantages`` does; divided by the group's standard deviation too when
    ``std_normalization`` (GRPO's; a group whose rewards are all equal stays 0).

    Returns ``(centred_B, group_std_B, constant_B)``: the centred rewards (0 where a sample has no
    reward, NaN in ``rewards_B``), each sample's group standard deviation (population), and
    whether its group's rewards are all equal (False without rewards, and for a lone sample).
    """
    rewards = rewards_B.double()
    centred = torch.zeros_like(rewards)
    spread = torch.zeros_like(rewards)
    constant = torch.zeros_like(rewards, dtype=torch.bool)
    for group in torch.unique(groups_B):
        rows = (groups_B == group) & ~torch.isnan(rewards)
        if not rows.any():
            continue
        values = rewards[rows]
        std = values.std(unbiased=False)
        centred[rows] = values - values.mean()
        if std_normalization and std > 0:
            centred[rows] /= std
        spread[rows] = std
        constant[rows] = len(values) > 1 and bool(
            (values == values[0]).all()
        )  # one sample: no group
    return centred.to(rewards_B.dtype), spread.to(rewards_B.dtype), constant
