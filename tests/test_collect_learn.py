"""The step in two halves (collect, learn) and the one teacher I/O type both halves share."""

import pytest
import torch

from opd.config import config_from_dict
from opd.teachers.base import TeacherInput, TeacherRequest
from opd.trainer import learn
from opd.trainer.learn import advantage_metrics
from opd.trainer.loop import Trainer


def test_learn_takes_a_finished_batch_and_fetches_nothing(base_config, monkeypatch):
    twin = Trainer(config_from_dict(base_config), progress=False)
    trainer = Trainer(config_from_dict(base_config), progress=False)
    batch = trainer.collect(0)
    assert batch.step == 0 and batch.on_policy
    assert set(batch.seconds) == {"time/sample", "time/teacher", "time/weight_sync"}

    def refuse(*_, **__):
        raise AssertionError("learn() must not sample or score")

    monkeypatch.setattr(trainer.parts.engine, "rollout", refuse)
    monkeypatch.setattr(trainer.parts.teachers, "score", refuse)
    learned = trainer.learn(batch)
    expected = twin.train_step(0)
    for key in expected:
        if not key.startswith("time/"):
            assert learned[key] == pytest.approx(expected[key], abs=1e-7), key


def test_a_batch_collected_earlier_is_learned_as_it_was_collected(base_config):
    """What collecting ahead of learning relies on: a batch keeps its version and scores."""
    trainer = Trainer(config_from_dict(base_config), progress=False)
    first, second = trainer.collect(0), trainer.collect(1)
    trainer.learn(first)
    assert (
        second.rollouts.policy_version_B.unique().tolist() == [0]
        and trainer.parts.policy.version == 1
    )
    metrics = trainer.learn(second)
    assert metrics["kl_sample_train"] != 0  # the student moved since it sampled this batch
    assert metrics["step"] == 1


@pytest.mark.parametrize(
    "request_", [TeacherRequest(), TeacherRequest(topk=4), TeacherRequest(hidden=True)]
)
def test_teacher_scores_of_a_padded_batch_equal_each_row_scored_alone(base_config, request_):
    trainer = Trainer(config_from_dict(base_config), progress=False)
    rollouts, _ = trainer.collector.sample_batch(0)
    teacher = trainer.parts.teachers.per_dataset[0]
    inputs = TeacherInput(
        rollouts.input_ids_BT, rollouts.attention_mask_BT, rollouts.mask_BT.bool()
    )
    together = teacher.score(inputs, request_)
    for row in range(inputs.input_ids_BT.shape[0]):
        alone = teacher.score(inputs.select(torch.tensor([row])), request_)
        width = alone.logprobs_BT.shape[1]
        torch.testing.assert_close(
            together.logprobs_BT[row, :width], alone.logprobs_BT[0], atol=1e-5, rtol=0
        )
        assert not together.logprobs_BT[row, width:].any()
        mask = rollouts.mask_BT[row : row + 1].bool()
        rows_together, rows_alone = (
            together.select(slice(row, row + 1)).rows(mask),
            alone.rows(mask[:, :width]),
        )
        if request_.topk:
            assert torch.equal(rows_together.topk_ids_NK, rows_alone.topk_ids_NK)
            torch.testing.assert_close(
                rows_together.topk_logprobs_NK, rows_alone.topk_logprobs_NK, atol=1e-5, rtol=0
            )
        if request_.hidden:
            torch.testing.assert_close(
                rows_together.heads[0].hidden_ND,
                rows_alone.heads[0].hidden_ND,
                atol=1e-5,
                rtol=1e-5,
            )
            assert together.head is teacher.lm_head


def test_two_teachers_answer_into_one_batch_as_each_would_alone(
    base_config, model_dirs, prompts_file
):
    base_config["datasets"].append(
        {
            "name": "self",
            "source": str(prompts_file),
            "groups_per_batch": 1,
            "group_size": 2,
            "teacher": {"model": str(model_dirs["student"])},
        }
    )
    base_config["training"]["objective"] = {"name": "topk_forward_kl", "topk": 3}
    trainer = Trainer(config_from_dict(base_config), progress=False)
    rollouts, _ = trainer.collector.sample_batch(0)
    scores = trainer.parts.teachers.score(rollouts)
    inputs = TeacherInput(
        rollouts.input_ids_BT, rollouts.attention_mask_BT, rollouts.mask_BT.bool()
    )
    for dataset_index, teacher in enumerate(trainer.parts.teachers.per_dataset):
        rows = (rollouts.dataset_index_B == dataset_index).nonzero().flatten()
        alone = teacher.score(inputs.select(rows), TeacherRequest(topk=3))
        width = alone.logprobs_BT.shape[1]
        torch.testing.assert_close(
            scores.logprobs_BT[rows, :width], alone.logprobs_BT, atol=1e-5, rtol=0
        )
        assert torch.equal(scores.topk_ids_BTK[rows, :width], alone.topk_ids_BTK)


def test_advantage_metrics_are_those_of_the_completion_tokens_only():
    """Hand-computed: tokens -3, -1, 2 and 0 (padding at 100 ignored): mean -0.5, std 1.8028."""
    advantages = torch.tensor([[-3.0, -1.0, 100.0], [2.0, 0.0, 100.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    metrics = advantage_metrics(advantages, mask)
    assert metrics["advantage/mean"] == pytest.approx(-0.5)
    assert metrics["advantage/std"] == pytest.approx((14 / 4 - 0.25) ** 0.5)
    assert (metrics["advantage/min"], metrics["advantage/max"]) == (-3.0, 2.0)
    assert advantage_metrics(advantages, torch.zeros_like(mask)) == {}


def test_a_step_logs_the_negated_sampled_reverse_kl_as_its_advantages(base_config):
    trainer = Trainer(config_from_dict(base_config), progress=False)
    batch = trainer.collect(0)
    metrics = trainer.learn(batch)
    selected = batch.rollouts.mask_BT.bool()
    reverse_kl = batch.rollouts.sampled_logprobs_BT[selected] - batch.teacher.logprobs_BT[selected]
    assert metrics["advantage/mean"] == pytest.approx(-float(reverse_kl.mean()), rel=1e-5)
    assert metrics["advantage/mean"] == pytest.approx(-metrics["teacher_kl"], rel=1e-5)
    assert metrics["advantage/min"] == pytest.approx(-float(reverse_kl.max()), rel=1e-5)


def test_normalized_advantages_are_what_a_step_learns_from(base_config, monkeypatch):
    """The update gets the clipped reverse KL less its batch mean over its batch spread; the
    logged advantages stay in nats; on-policy the importance-sampling loss is then about 0."""
    base_config["training"] |= {"normalize_advantages": True, "advantage_clip": 0.05}
    trainer = Trainer(config_from_dict(base_config), progress=False)
    received = []
    update = learn.policy_update
    monkeypatch.setattr(
        learn, "policy_update", lambda *a, **k: received.append(a[6]) or update(*a, **k)
    )
    batch = trainer.collect(0)
    metrics = trainer.learn(batch)
    selected = batch.rollouts.mask_BT.bool()
    reverse_kl = batch.rollouts.sampled_logprobs_BT[selected] - batch.teacher.logprobs_BT[selected]
    nats = (-reverse_kl).clamp(-0.05, 0.05)
    (advantages_BT,) = received
    expected = (nats - nats.mean()) / nats.std(unbiased=False)
    torch.testing.assert_close(advantages_BT[selected], expected, rtol=1e-4, atol=1e-5)
    assert float(advantages_BT[~selected].abs().max()) == 0
    assert metrics["advantage/mean"] == pytest.approx(float(nats.mean()), rel=1e-5)
    assert abs(metrics["loss"]) < 1e-3 < abs(float(nats.mean()))


def test_advantage_clip_bounds_the_advantages_a_step_learns_from(base_config):
    """The clip reaches the loop: a step's advantages are its reverse KL, clamped at 0.05 nats."""
    base_config["training"]["advantage_clip"] = 0.05
    trainer = Trainer(config_from_dict(base_config), progress=False)
    batch = trainer.collect(0)
    metrics = trainer.learn(batch)
    selected = batch.rollouts.mask_BT.bool()
    reverse_kl = batch.rollouts.sampled_logprobs_BT[selected] - batch.teacher.logprobs_BT[selected]
    expected = (-reverse_kl).clamp(-0.05, 0.05)
    assert float(reverse_kl.abs().max()) > 0.05  # the clip engages on this batch
    assert metrics["advantage/mean"] == pytest.approx(float(expected.mean()), rel=1e-5)
    assert metrics["advantage/min"] == pytest.approx(float(expected.min()), rel=1e-5)
    assert metrics["advantage/max"] == pytest.approx(float(expected.max()), rel=1e-5)


@pytest.mark.parametrize(
    ("settings", "source"),
    [
        ({"advantage_logprobs": "behaviour"}, "behaviour"),
        ({"advantage_logprobs": "current"}, "current"),
        ({}, "behaviour"),  # unset, synchronous: the recorded log-probs are the policy's own
        ({"max_staleness": 2}, "current"),  # unset, collecting ahead: the remedy
        ({"max_staleness": 2, "advantage_logprobs": "behaviour"}, "behaviour"),
    ],
)
def test_the_advantages_are_built_from_the_behaviour_or_the_current_log_probs(
    base_config, settings, source
):
    """A stale sampler: the batch's recorded log-probs are 0.3 nats off the student's. ``current``
    builds the reverse-KL advantage from the student's own log-probs (one forward before the
    update), ``behaviour`` from the recorded ones; the logged teacher KL stays the sampled one."""
    base_config["training"] |= settings
    trainer = Trainer(config_from_dict(base_config), progress=False)
    batch = trainer.collect(0)
    selected = batch.rollouts.mask_BT.bool()
    current = trainer.learner.policy_logprobs(batch.rollouts)
    assert not current.requires_grad  # an advantage is a constant: no gradient may flow through it
    assert float((current - batch.rollouts.sampled_logprobs_BT)[selected].abs().max()) < 1e-4
    batch.rollouts.sampled_logprobs_BT[selected] += 0.3
    metrics = trainer.learn(batch)
    teacher = batch.teacher.logprobs_BT[selected]
    student = (
        current[selected] if source == "current" else batch.rollouts.sampled_logprobs_BT[selected]
    )
    assert metrics["advantage/mean"] == pytest.approx(-float((student - teacher).mean()), rel=1e-5)
    assert metrics["teacher_kl"] == pytest.approx(
        float((batch.rollouts.sampled_logprobs_BT[selected] - teacher).mean()), rel=1e-5
    )
    assert metrics["kl_sample_train"] == pytest.approx(
        0.3, abs=1e-3
    )  # the ratio stays on the behaviour
