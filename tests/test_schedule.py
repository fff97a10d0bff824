"""A data-source schedule: ``training.lmbda`` moving from the teacher's samples to the student's."""

from __future__ import annotations

import math

import pytest
import yaml

from opd.cli import main
from opd.config import LambdaSchedule, TrainingConfig, config_from_dict
from opd.errors import ConfigError
from opd.runs.metrics import read_jsonl
from opd.trainer.collect import step_data_source


def test_the_schedule_by_hand():
    linear = LambdaSchedule(start=0.0, end=1.0, steps=4)
    assert [linear.at(step) for step in range(6)] == [0.0, 0.25, 0.5, 0.75, 1.0, 1.0]
    down = LambdaSchedule(start=0.8, end=0.2, steps=3)
    assert [round(down.at(step), 6) for step in range(4)] == [0.8, 0.6, 0.4, 0.2]
    step = LambdaSchedule(start=0.0, end=1.0, steps=3, shape="step")
    assert [step.at(s) for s in range(5)] == [0.0, 0.0, 0.0, 1.0, 1.0]
    assert TrainingConfig(lmbda=0.3).lmbda_at(1000) == 0.3


def test_the_share_of_student_batches_per_step_follows_the_schedule_over_seeds():
    """At each step, over 4,000 run seeds, the share of on-policy batches is the schedule's value
    within 4 binomial standard errors; a step schedule's ends are exact."""
    training = TrainingConfig(
        data_source="mixed", lmbda=LambdaSchedule(start=0.0, end=1.0, steps=4)
    )
    seeds = range(4000)
    for step in range(6):
        expected = training.lmbda_at(step)
        share = sum(step_data_source(training, seed, step) == "student" for seed in seeds) / len(
            seeds
        )
        assert abs(share - expected) <= 4 * math.sqrt(
            max(expected * (1 - expected), 1e-12) / len(seeds)
        )
    cliff = TrainingConfig(data_source="mixed", lmbda=LambdaSchedule(steps=2, shape="step"))
    assert {step_data_source(cliff, seed, step) for seed in range(200) for step in (0, 1)} == {
        "teacher"
    }
    assert {step_data_source(cliff, seed, 2) for seed in range(200)} == {"student"}


def test_bad_schedules_name_the_field(base_config, tmp_path):
    for lmbda, field in (
        ({"start": 0.0, "end": 1.5}, "training.lmbda.end: must be in [0, 1]"),
        ({"start": 0.0, "steps": 0}, "training.lmbda.steps"),
    ):
        base_config["training"].update(data_source="mixed", lmbda=lmbda)
        with pytest.raises(ConfigError, match=field.replace("[", r"\[").replace("]", r"\]")):
            config_from_dict(base_config)


def test_a_run_resumed_mid_schedule_continues_it_exactly(base_config, tmp_path):
    """Two steps, then the same run extended to five, against five in one go: the same sources,
    the same logged lmbda, the same numbers."""
    base_config["training"].update(
        objective="jsd",
        data_source="mixed",
        lmbda={"start": 0.0, "end": 1.0, "steps": 4},
        max_steps=5,
    )
    whole = tmp_path / "whole.yaml"
    whole.write_text(yaml.safe_dump(base_config | {"log_path": str(tmp_path / "whole")}))
    assert main(["train", str(whole), "--no-progress"]) == 0
    split = tmp_path / "split.yaml"
    split.write_text(yaml.safe_dump(base_config | {"log_path": str(tmp_path / "split")}))
    assert main(["train", str(split), "training.max_steps=2", "--no-progress"]) == 0
    assert main(["train", str(split), "--no-progress"]) == 0
    reference, resumed = (
        read_jsonl(tmp_path / name / "metrics.jsonl") for name in ("whole", "split")
    )
    assert [row["lmbda"] for row in reference] == [0.0, 0.25, 0.5, 0.75, 1.0]
    assert reference[0]["on_policy"] == 0 and reference[4]["on_policy"] == 1
    keys = ("step", "on_policy", "lmbda", "loss")
    assert [[row[k] for k in keys] for row in resumed] == [
        [row[k] for k in keys] for row in reference
    ]
