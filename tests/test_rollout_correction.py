"""Rollout correction: the weight of a token the sampler and the trainer disagree on, bounded
(truncated or masked, per token or per completion), against hand-worked values; matched runs
unchanged; the settings checked by name."""

import math

import pytest
import torch

from opd.config import ConfigError, config_from_dict
from opd.objectives.policy_losses import PolicyGradient
from opd.objectives.rollout_correction import RolloutCorrection, correction_sums
from opd.trainer.loop import Trainer, train

LOG = math.log


def gradient(policy: PolicyGradient, trainer, sampler, advantages, sequence=None) -> list[float]:
    """d loss / d (trainer log-prob) of each token."""
    logp = torch.tensor(trainer, requires_grad=True)
    loss = policy.loss(logp, torch.tensor(sampler), torch.tensor(advantages), sequence)
    loss.sum().backward()
    return logp.grad.tolist()


# the trainer and the sampler agree on token 0, the trainer finds token 1 ten times likelier, and
# token 2 ten times less likely
TRAINER = [LOG(0.5), LOG(0.1), LOG(0.01)]
SAMPLER = [LOG(0.5), LOG(0.01), LOG(0.1)]
ADVANTAGES = [1.0, 1.0, 1.0]


def test_uncorrected_the_ratio_weighs_each_token_as_it_is():
    assert gradient(PolicyGradient(), TRAINER, SAMPLER, ADVANTAGES) == pytest.approx(
        [-1.0, -10.0, -0.1]
    )


def test_truncate_caps_each_tokens_weight():
    corrected = PolicyGradient(correction=RolloutCorrection("truncate", "token", 2.0))
    assert gradient(corrected, TRAINER, SAMPLER, ADVANTAGES) == pytest.approx([-1.0, -2.0, -0.1])


def test_mask_drops_tokens_outside_the_band_and_keeps_the_rest_on_policy():
    corrected = PolicyGradient(correction=RolloutCorrection("mask", "token", 2.0))
    assert gradient(corrected, TRAINER, SAMPLER, ADVANTAGES) == pytest.approx([-1.0, 0.0, 0.0])


def test_a_sequence_takes_the_geometric_mean_of_its_tokens_ratios():
    """Completion 0: ratios 1 and 4 (geometric mean 2); completion 1: ratio 1/10 alone."""
    trainer = [LOG(0.5), LOG(0.4), LOG(0.01)]
    sampler = [LOG(0.5), LOG(0.1), LOG(0.1)]
    sequence = torch.tensor([0, 0, 1])
    truncate = PolicyGradient(correction=RolloutCorrection("truncate", "sequence", 1.5))
    assert gradient(truncate, trainer, sampler, ADVANTAGES, sequence) == pytest.approx(
        [-1.5, -1.5, -0.1]
    )
    mask = PolicyGradient(correction=RolloutCorrection("mask", "sequence", 3.0))
    assert gradient(mask, trainer, sampler, ADVANTAGES, sequence) == pytest.approx(
        [-1.0, -1.0, 0.0]
    )


def test_the_loss_functions_keep_their_shape_under_the_correction():
    """ppo against the trainer's own log-probs: ratio 1, inside any clip, so the weight alone
    scales the gradient, as for importance sampling."""
    corrected = PolicyGradient("ppo", correction=RolloutCorrection("truncate", "token", 2.0))
    assert gradient(corrected, TRAINER, SAMPLER, [2.0, -1.0, 1.0]) == pytest.approx(
        [-2.0, 2.0, -0.1]
    )


def test_the_metrics_count_what_the_correction_did():
    mask_BT = torch.tensor([[0, 1, 1, 1]])
    trainer_BT = torch.tensor([[0.0, *TRAINER]])
    sampler_BT = torch.tensor([[0.0, *SAMPLER]])
    mismatch, weights, bounded, largest = correction_sums(
        RolloutCorrection("truncate", "token", 2.0), trainer_BT, sampler_BT, mask_BT
    )
    k3 = sum(r - 1 - math.log(r) for r in (1.0, 10.0, 0.1))
    assert mismatch == pytest.approx(k3)
    assert (weights, bounded, largest) == pytest.approx((1.0 + 2.0 + 0.1, 1.0, 2.0))


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ({"cap": 1.0}, r"training\.rollout_correction\.cap: must be > 1"),
        (
            {"mode": "clip"},
            r"training\.rollout_correction\.mode: 'clip' is not one of \['truncate', 'mask'\]",
        ),
        ({"level": "batch"}, r"training\.rollout_correction\.level: 'batch' is not one of"),
        (
            {"cap": 2.0, "caps": 3},
            r"training\.rollout_correction\.caps: unknown key; did you mean "
            r"'training\.rollout_correction\.cap'",
        ),
    ],
)
def test_bad_settings_are_refused_by_name(base_config, setting, message):
    config = dict(base_config, training=dict(base_config["training"], rollout_correction=setting))
    with pytest.raises(ConfigError, match=message):
        config_from_dict(config)


def test_a_matched_run_trains_as_uncorrected_and_logs_the_correction(base_config, tmp_path):
    """The sampler is the trainer here (ratios 1 within float noise): the same metrics step for
    step, and the correction's own say it changed nothing."""
    training = dict(base_config["training"], objective="sampled_reverse_kl", max_steps=3)
    plain = train(config_from_dict(dict(base_config, training=training)), progress=False).metrics
    corrected_training = dict(training, rollout_correction={"mode": "truncate", "cap": 2.0})
    corrected = train(
        config_from_dict(
            dict(base_config, log_path=str(tmp_path / "c"), training=corrected_training)
        ),
        progress=False,
    ).metrics
    for a, b in zip(plain, corrected, strict=True):
        assert b["teacher_kl"] == pytest.approx(a["teacher_kl"], abs=1e-5)
        assert b["loss"] == pytest.approx(a["loss"], abs=1e-5)
        assert b["rollout_correction/capped_frac"] == 0.0
        assert b["rollout_correction/weight_max"] == pytest.approx(1.0, abs=1e-4)
        assert 0.0 <= b["rollout_correction/mismatch_kl"] < 1e-6
    assert "rollout_correction/weight_mean" not in plain[0]


def test_a_mismatched_sampler_is_capped_in_a_real_run(base_config, tmp_path):
    """A sampler that reports every other token 20 times less likely than the trainer finds it:
    those tokens' weights are capped at 2, the rest kept, and the logged mismatch is k3's."""
    training = dict(
        base_config["training"],
        objective="sampled_reverse_kl",
        max_steps=1,
        rollout_correction={"mode": "truncate", "cap": 2.0},
    )
    trainer = Trainer(config_from_dict(dict(base_config, training=training)), progress=False)
    batch = trainer.collect(0)
    rollouts = batch.rollouts
    positions = rollouts.mask_BT.bool().clone()
    positions[:, ::2] = False
    shifted = positions & rollouts.mask_BT.bool()
    rollouts.sampled_logprobs_BT[shifted] -= math.log(20.0)
    metrics = trainer.learn(batch)
    share = float(shifted.sum() / rollouts.mask_BT.sum())
    assert metrics["rollout_correction/capped_frac"] == pytest.approx(share, abs=1e-6)
    assert metrics["rollout_correction/weight_max"] == pytest.approx(2.0)
    assert metrics["rollout_correction/weight_mean"] == pytest.approx(
        share * 2.0 + (1 - share), abs=1e-3
    )
    assert metrics["rollout_correction/mismatch_kl"] == pytest.approx(
        share * (20 - 1 - math.log(20)), rel=1e-3
    )


def test_the_unset_correction_is_on_where_the_sampler_is_not_the_trainers_forward(
    base_config, tmp_path
):
    def resolved(student: dict, training: dict | None = None, **top):
        config = dict(base_config, student=dict(base_config["student"], **student), **top)
        config["training"] = dict(base_config["training"], **(training or {}))
        return config_from_dict(config).training.rollout_correction

    assert resolved({}) == "off"  # the trainer's own forward samples: ratios are 1
    assert resolved({"sampling_dtype": "bfloat16"}) == RolloutCorrection("truncate", "token", 2.0)
    assert resolved({"sampler": "vllm_server", "rollout_servers": ["http://127.0.0.1:1"]}) == (
        RolloutCorrection("truncate", "token", 2.0)
    )
    assert resolved({"sampling_dtype": "bfloat16"}, {"rollout_correction": "off"}) == "off"
    assert (
        resolved({"sampling_dtype": "bfloat16"}, {"rollout_correction": False}) == "off"
    )  # YAML's off
    # a run recorded before the setting existed goes on uncorrected when resumed
    run = tmp_path / "old"
    run.mkdir()
    (run / "config.yaml").write_text("training: {learning_rate: 0.001}\n")
    old = resolved({"sampling_dtype": "bfloat16"}, log_path=str(run))
    assert old == "off"
