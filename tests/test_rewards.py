"""Reward and KL in one advantage: the task's reward of each of the student's own samples, centred
within its group (the samples of one prompt), beside the teacher's per-token signal."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch

from opd.cli import main
from opd.config import ConfigError, config_from_dict
from opd.objectives.advantages import group_centred_rewards, reverse_kl_per_token
from opd.trainer import learn
from opd.trainer.loop import Trainer, train
from tests.test_envs import episode_config, episode_models  # noqa: F401  (a fixture)

WORDS = ("abc", "hgf", "dcea", "bbad", "gah", "fed", "cab", "ggf")


@pytest.fixture
def graded_config(base_config, tmp_path):
    """``base_config`` on prompts that all have an answer (so the dataset has a grader)."""
    path = tmp_path / "graded.jsonl"
    path.write_text(
        "".join(json.dumps({"prompt": f"reverse {w}", "answer": w[::-1]}) + "\n" for w in WORDS)
    )
    base_config["datasets"][0]["source"] = str(path)
    return base_config


def length_parity(text: str, prompt) -> float:
    """A grader whose grades differ within a group of a random student's samples."""
    return float(len(text) % 2)


def captured_update(monkeypatch) -> list[dict]:
    """The advantages, rows and reward flag each call of the update receives."""
    received = []
    update = learn.policy_update

    def spy(*args, **kwargs):
        received.append({"rollouts": args[4], "advantages": args[6], **kwargs})
        return update(*args, **kwargs)

    monkeypatch.setattr(learn, "policy_update", spy)
    return received


def test_group_centred_rewards_by_hand():
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.5, math.nan, 2.0, 0.0], dtype=torch.float64)
    groups = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
    centred, spread, constant = group_centred_rewards(rewards, groups)
    # group 0: mean 0.5; group 1: all 1 (constant); group 2: one graded row; group 3: mean 1
    assert centred.tolist() == [0.5, -0.5, 0.0, 0.0, 0.0, 0.0, 1.0, -1.0]
    assert spread.tolist() == [0.5, 0.5, 0.0, 0.0, 0.0, 0.0, 1.0, 1.0]
    assert constant.tolist() == [
        False,
        False,
        True,
        True,
        False,
        False,
        False,
        False,
    ]  # a lone row: no group
    normalized, _, _ = group_centred_rewards(rewards, groups, std_normalization=True)
    assert normalized.tolist() == [1.0, -1.0, 0.0, 0.0, 0.0, 0.0, 1.0, -1.0]


def test_a_two_group_batch_advantage_is_the_kl_term_plus_the_centred_reward(
    graded_config, monkeypatch
):
    graded_config["training"] |= {"reward_coef": 0.5}
    trainer = Trainer(config_from_dict(graded_config), progress=False)
    received = captured_update(monkeypatch)
    batch = trainer.collect(0)
    assert batch.rewards_B is not None and batch.groups_B.tolist() == [0, 0, 1, 1]
    batch.rewards_B = torch.tensor(
        [1.0, 0.0, 0.25, 0.75], dtype=torch.float64
    )  # grades set by hand
    metrics = trainer.learn(batch)
    mask = batch.rollouts.mask_BT
    kl = -reverse_kl_per_token(batch.rollouts.sampled_logprobs_BT, batch.teacher.logprobs_BT, mask)
    # group means 0.5 and 0.5: centred 0.5, -0.5, -0.25, 0.25; times reward_coef 0.5
    expected = kl + torch.tensor([0.25, -0.25, -0.125, 0.125])[:, None] * mask
    torch.testing.assert_close(received[0]["advantages"], expected, rtol=0, atol=1e-6)
    assert received[0]["reward_in_loss"] is False
    assert metrics["reward/mean"] == pytest.approx(0.5)
    assert metrics["reward/rev"] == pytest.approx(0.5)
    assert metrics["reward/group_std"] == pytest.approx((0.5 + 0.25) / 2)
    assert metrics["reward/constant_groups"] == 0.0
    tokens = mask.sum()
    assert metrics["advantage/reward_abs_mean"] == pytest.approx(
        float((torch.tensor([0.25, 0.25, 0.125, 0.125])[:, None] * mask).sum() / tokens), rel=1e-6
    )
    assert metrics["advantage/kl_abs_mean"] == pytest.approx(
        float(kl.abs().sum() / tokens), rel=1e-5
    )


def test_the_rewards_are_the_graders_grades_of_the_decoded_samples(graded_config):
    trainer = Trainer(config_from_dict(graded_config), progress=False)
    trainer.parts.graders[0] = length_parity
    batch = trainer.collect(0)
    texts = [
        trainer.parts.tokenizer.decode(row[start:][mask.bool()[start:]], skip_special_tokens=True)
        for row, mask, start in zip(
            batch.rollouts.input_ids_BT,
            batch.rollouts.mask_BT,
            batch.rollouts.prompt_lengths,
            strict=True,
        )
    ]
    assert batch.rewards_B.tolist() == [float(len(t) % 2) for t in texts]
    metrics = trainer.learn(batch)  # reward_coef 0: logged all the same
    assert metrics["reward/mean"] == pytest.approx(sum(len(t) % 2 for t in texts) / len(texts))


def test_reward_coef_zero_trains_exactly_as_without_rewards(graded_config, tmp_path):
    graded_config["training"]["reward_coef"] = 0.0
    with_rewards = train(config_from_dict(graded_config), progress=False)
    assert "reward/mean" in with_rewards.metrics[0]
    ungraded = copy.deepcopy(graded_config) | {"log_path": str(tmp_path / "ungraded")}
    ungraded["datasets"][0]["grader"] = "none"
    without = train(config_from_dict(ungraded), progress=False)
    assert "reward/mean" not in without.metrics[0]
    for (name, value), (_, other) in zip(
        with_rewards.student.state_dict().items(), without.student.state_dict().items(), strict=True
    ):
        assert torch.equal(value, other), name


def test_constant_groups_are_left_out_of_the_update(graded_config, monkeypatch):
    graded_config["training"] |= {"reward_coef": 1.0, "remove_constant_reward_groups": True}
    trainer = Trainer(config_from_dict(graded_config), progress=False)
    received = captured_update(monkeypatch)
    batch = trainer.collect(0)
    batch.rewards_B = torch.tensor([1.0, 1.0, 0.0, 1.0], dtype=torch.float64)  # group 0 constant
    metrics = trainer.learn(copy.deepcopy(batch))
    assert metrics["reward/constant_groups"] == 0.5
    assert metrics["reward/kept_rows"] == 0.5  # the filter's metrics count what the update keeps
    assert (
        metrics["num_tokens_kept"] == int(batch.rollouts.mask_BT[2:].sum()) < metrics["num_tokens"]
    )
    sent = received[0]["rollouts"].mask_BT
    assert not sent[:2].any() and torch.equal(sent[2:], batch.rollouts.mask_BT[2:])
    before = copy.deepcopy(trainer.parts.policy.model.state_dict())
    batch.rewards_B = torch.tensor(
        [0.0, 0.0, 1.0, 1.0], dtype=torch.float64
    )  # every group constant
    metrics = trainer.learn(batch)
    assert (
        metrics["skipped"] == 1 and metrics["reward/constant_groups"] == 1.0 and len(received) == 1
    )
    assert metrics["reward/kept_rows"] == 0.0 and metrics["num_tokens_kept"] == 0
    for name, value in trainer.parts.policy.model.state_dict().items():
        assert torch.equal(value, before[name]), name


def gradients_of_learning(trainer: Trainer, batch) -> list[torch.Tensor]:
    """The gradient the update steps with (one substep), taken as the optimizer is called."""
    seen = []
    step = trainer.parts.optimizer.step

    def spy(*args, **kwargs):
        seen.append([p.grad.detach().clone() for p in trainer.parts.policy.trainable_parameters()])
        return step(*args, **kwargs)

    trainer.parts.optimizer.step = spy
    state = copy.deepcopy(trainer.parts.policy.model.state_dict())
    trainer.learn(batch)
    trainer.parts.policy.model.load_state_dict(state)
    trainer.parts.optimizer.step = step
    return seen[0]


@pytest.mark.parametrize("objective", ["k3", "topk_forward_kl", "jsd"])
def test_objectives_without_advantages_add_the_reward_as_a_policy_gradient(
    graded_config, monkeypatch, objective
):
    """The reward moves the gradient by exactly the policy gradient ``-mean_t A_t grad log p(x_t)``
    (on-policy, where the importance ratio is 1), computed here by autograd on its own."""
    graded_config["training"] |= {"objective": objective, "reward_coef": 2.0, "max_grad_norm": None}
    trainer = Trainer(config_from_dict(graded_config), progress=False)
    received = captured_update(monkeypatch)
    batch = trainer.collect(0)
    batch.rewards_B = torch.tensor([1.0, 0.0, 0.0, 0.0], dtype=torch.float64)
    with_reward = gradients_of_learning(trainer, copy.deepcopy(batch))
    advantages = received[0]["advantages"]
    assert received[0]["reward_in_loss"] is True
    rollouts = batch.rollouts
    mask = rollouts.mask_BT
    torch.testing.assert_close(advantages, torch.tensor([1.0, -1.0, 0.0, 0.0])[:, None] * mask)
    batch.rewards_B = torch.zeros(4, dtype=torch.float64)
    without = gradients_of_learning(trainer, batch)
    trainer.parts.policy.model.zero_grad()
    logprobs, _ = trainer.parts.policy.sequence_logprobs(
        rollouts.input_ids_BT, rollouts.attention_mask_BT, mask, temperature=1.0
    )
    (-(advantages * logprobs * mask).sum() / mask.sum()).backward()
    expected = [p.grad for p in trainer.parts.policy.trainable_parameters()]
    assert max(float(e.abs().max()) for e in expected) > 1e-3  # the term is not trivially zero
    for got, base, term in zip(with_reward, without, expected, strict=True):
        torch.testing.assert_close(got - base, term, rtol=1e-4, atol=1e-6)


def test_episodes_are_rewarded_by_their_environment_and_learn_on_their_own_turns(
    episode_models,  # noqa: F811
    prompts_file,
    tmp_path,
    monkeypatch,
):
    config = episode_config(episode_models, prompts_file, tmp_path)
    config["training"]["reward_coef"] = 1.0
    trainer = Trainer(config_from_dict(config), progress=False)
    received = captured_update(monkeypatch)
    batch = trainer.collect(0)
    expected = [t.reward or 0.0 for t in batch.rollouts.trajectories]
    assert batch.rewards_B.tolist() == expected and len(set(expected)) > 1
    trainer.learn(batch)
    mask = batch.rollouts.mask_BT
    kl = -reverse_kl_per_token(batch.rollouts.sampled_logprobs_BT, batch.teacher.logprobs_BT, mask)
    centred, _, _ = group_centred_rewards(batch.rewards_B, batch.groups_B)
    assert centred.abs().sum() > 0  # some group tells its samples apart
    reward_BT = centred.float()[:, None] * mask  # on the student's tokens only, not the replies
    torch.testing.assert_close(received[0]["advantages"], kl + reward_BT, rtol=0, atol=1e-6)


def test_collection_ahead_rewards_the_batches_it_collects(graded_config):
    graded_config["training"] |= {"reward_coef": 1.0, "max_steps": 3}
    synchronous = train(config_from_dict(graded_config), progress=False).metrics
    graded_config["training"]["max_staleness"] = 1
    graded_config["log_path"] += "-ahead"
    ahead = train(config_from_dict(graded_config), progress=False).metrics
    # step 0 is sampled from the same weights either way; later steps from weights one update older
    assert ahead[0]["reward/mean"] == synchronous[0]["reward/mean"]
    assert ahead[0]["reward/group_std"] == synchronous[0]["reward/group_std"]
    assert all("reward/mean" in row for row in ahead)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["training.reward_coef=-0.5"], r"training\.reward_coef: must be >= 0, got -0\.5"),
        (["training.reward_coef=lots"], r"training\.reward_coef: expected float, got str 'lots'"),
        (
            ["training.remove_constant_reward_groups=true"],
            r"training\.remove_constant_reward_groups: shapes the reward term, and reward_coef is "
            r"0",
        ),
        (
            ["training.reward_coef=1", "training.objective=nll", "training.data_source=teacher"],
            r"training\.reward_coef: rewards the student's own samples, and data_source: teacher",
        ),
    ],
)
def test_bad_reward_settings_are_refused_by_name(graded_config, overrides, message):
    with pytest.raises(ConfigError, match=message):
        config_from_dict(graded_config, overrides)


def test_a_reward_without_a_grader_is_refused_before_any_work(graded_config, tmp_path, capsys):
    graded_config["datasets"][0]["grader"] = "none"
    graded_config["training"]["reward_coef"] = 1.0
    path = tmp_path / "run.yaml"
    path.write_text(json.dumps(graded_config))
    assert main(["train", str(path), "--no-progress"]) == 2
    error = capsys.readouterr().err
    assert "datasets[0] (rev): training.reward_coef > 0 needs a reward" in error
    assert "Traceback" not in error and not (tmp_path / "run" / "metrics.jsonl").exists()


def test_an_environment_reward_that_is_no_number_names_the_dataset_and_step(
    episode_models,  # noqa: F811
    prompts_file,
    tmp_path,
    capsys,
):
    config = episode_config(
        episode_models, prompts_file, tmp_path, env={"name": "multi_turn_envs:WordReward"}
    )
    path = tmp_path / "run.yaml"
    path.write_text(json.dumps(config))
    assert main(["train", str(path), "--no-progress"]) != 0
    error = capsys.readouterr().err
    assert (
        "step 0: datasets[0] (rev): the environment's answer to turn 1: reward must be a number"
        in error
    )
    assert "Traceback" not in error
