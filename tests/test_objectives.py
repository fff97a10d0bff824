"""Advantages and policy losses against hand-computed values."""

import math

import pytest
import torch

from opd.objectives.advantages import (
    discounted_future_sum,
    kl_advantages,
    reverse_kl_per_token,
    standardized,
)
from opd.objectives.policy_losses import aggregate, cispo, dro, importance_sampling, ppo


def test_discounted_future_sum_by_hand():
    values = torch.tensor([[1.0, 2.0, 3.0], [0.0, 0.0, 4.0]])
    out = discounted_future_sum(values, 0.5)
    # row 0: t2 = 3; t1 = 2 + 0.5*3 = 3.5; t0 = 1 + 0.5*3.5 = 2.75
    torch.testing.assert_close(out, torch.tensor([[2.75, 3.5, 3.0], [1.0, 2.0, 4.0]]))


def test_kl_advantages_by_hand_and_masking():
    sampled = torch.tensor([[0.0, -1.0, -0.5, -2.0]])
    teacher = torch.tensor([[-9.0, -0.5, -1.5, -7.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0, 0.0]])
    torch.testing.assert_close(
        reverse_kl_per_token(sampled, teacher, mask), torch.tensor([[0.0, -0.5, 1.0, 0.0]])
    )
    adv = kl_advantages(sampled, teacher, mask, kl_penalty_coef=2.0)
    torch.testing.assert_close(adv, torch.tensor([[0.0, 1.0, -2.0, 0.0]]))
    discounted = kl_advantages(sampled, teacher, mask, kl_penalty_coef=2.0, kl_discount_factor=0.5)
    # t2 = -2; t1 = 1 + 0.5 * -2 = 0; masked positions stay 0
    torch.testing.assert_close(discounted, torch.tensor([[0.0, 0.0, -2.0, 0.0]]))
    clipped = kl_advantages(sampled, teacher, mask, kl_penalty_coef=2.0, clip=1.5)
    torch.testing.assert_close(clipped, torch.tensor([[0.0, 1.0, -1.5, 0.0]]))
    # the clip applies after the discount: t1 = 1 + 0.5 * -2 = 0 stays, t2 = -2 -> -1.5
    both = kl_advantages(
        sampled, teacher, mask, kl_penalty_coef=2.0, kl_discount_factor=0.5, clip=1.5
    )
    torch.testing.assert_close(both, torch.tensor([[0.0, 0.0, -1.5, 0.0]]))


def test_standardized_advantages_by_hand():
    """Completion tokens 1, 3, 5 (mean 3, spread sqrt(8/3)) become -1.2247, 0, 1.2247; padding stays
    0; a batch without spread gives 0 everywhere, not a division by 0."""
    advantages_BT = torch.tensor([[1.0, 3.0, 7.0], [5.0, 9.0, 9.0]])
    mask_BT = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    got = standardized(advantages_BT, mask_BT, mean=3.0, std=math.sqrt(8 / 3))
    torch.testing.assert_close(got, torch.tensor([[-1.224745, 0.0, 0.0], [1.224745, 0.0, 0.0]]))
    alike_BT = torch.full((2, 3), 2.0)  # no spread: every token is the mean, none is singled out
    assert torch.equal(standardized(alike_BT, mask_BT, mean=2.0, std=0.0), torch.zeros(2, 3))


def test_identical_teacher_gives_zero_advantages():
    logp = torch.randn(3, 5)
    mask = torch.ones(3, 5)
    assert torch.all(
        kl_advantages(logp, logp.clone(), mask, kl_penalty_coef=1.0, kl_discount_factor=0.9) == 0
    )


R = math.exp(0.2)  # exp(-1.0 - (-1.2))


@pytest.mark.parametrize(
    ("loss_fn", "advantage", "expected"),
    [
        (importance_sampling, 0.5, -R * 0.5),
        (ppo, 0.5, -min(R * 0.5, 1.2 * 0.5)),
        (ppo, -0.5, -min(R * -0.5, 1.2 * -0.5)),
        (cispo, 0.5, -1.2 * -1.0 * 0.5),
        (dro, 0.5, -(-1.0 * 0.5 - 0.05 / 2 * 0.2**2)),
    ],
)
def test_losses_match_formulas(loss_fn, advantage, expected):
    logp = torch.tensor([[-1.0]])
    sampler = torch.tensor([[-1.2]])
    value = loss_fn(logp, sampler, torch.tensor([[advantage]]), {})
    assert value.item() == pytest.approx(expected, rel=1e-6)


def test_loss_config_knobs_are_used():
    logp, sampler, adv = torch.tensor([[-1.0]]), torch.tensor([[-1.2]]), torch.tensor([[1.0]])
    assert ppo(logp, sampler, adv, {"clip_high_threshold": 1.1}).item() == pytest.approx(-1.1)
    assert dro(logp, sampler, adv, {"beta": 1.0}).item() == pytest.approx(1.0 + 0.5 * 0.04)


def test_on_policy_importance_sampling_gradient_is_kl_weighted_score():
    """At r = 1 the gradient is coef * (logp - logq) * dlogp (NOTES section 1)."""
    theta = torch.tensor([0.3, -0.2], requires_grad=True)
    logp = torch.log_softmax(theta, -1)[None, :]
    teacher = torch.tensor([[-0.1, -2.5]])
    mask = torch.ones(1, 2)
    advantages = kl_advantages(logp.detach(), teacher, mask, kl_penalty_coef=0.7)
    importance_sampling(logp, logp.detach(), advantages, {}).sum().backward()
    expected = torch.zeros(2)
    for t in range(2):
        score = torch.autograd.grad(torch.log_softmax(theta, -1)[t], theta)[0]
        expected += 0.7 * (logp[0, t].detach() - teacher[0, t]) * score
    torch.testing.assert_close(theta.grad, expected)


def test_aggregations_by_hand():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    assert aggregate(loss, mask, "sum", 4, 2).item() == pytest.approx(10.0)
    assert aggregate(loss, mask, "token_mean", 4, 2).item() == pytest.approx(2.5)
    assert aggregate(loss, mask, "sequence_mean", 4, 2).item() == pytest.approx((2.0 + 4.0) / 2)
    # A micro-batch (first row) normalised by the whole batch's counts.
    assert aggregate(loss[:1], mask[:1], "token_mean", 4, 2).item() == pytest.approx(1.5)
