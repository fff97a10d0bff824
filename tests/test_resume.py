"""Checkpoints and resume: a real SIGKILL, interrupted saves, corrupt files, config changes."""

import json
import os
import signal
import subprocess
import sys
import time
import warnings

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM

from opd.config import ConfigError, config_from_dict
from opd.runs.checkpoints import CheckpointError, list_checkpoints
from opd.runs.metrics import read_jsonl
from opd.trainer.loop import Trainer, train
from tests.conftest import quick_to_stop, tiny_llama, trained_and_loading

STEPS = 8


def comparable(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.startswith("time/")}


def assert_same_rows(rows_a, rows_b):
    assert [r["step"] for r in rows_a] == [r["step"] for r in rows_b]
    for a, b in zip(rows_a, rows_b, strict=True):
        a, b = comparable(a), comparable(b)
        assert a.keys() == b.keys()
        for key in a:
            if isinstance(a[key], float):
                assert a[key] == pytest.approx(b[key], abs=1e-6), (a["step"], key)
            else:
                assert a[key] == b[key], (a["step"], key)


def write_config(base_config, tmp_path, name, **top):
    config = dict(base_config, log_path=str(tmp_path / name), save_every=2, **top)
    # a warmed-up, decaying LR: a resumed run must pick the schedule up where it stopped
    config["training"] = dict(
        base_config["training"],
        max_steps=STEPS,
        learning_rate=1e-2,
        warmup_steps=2,
        lr_schedule="cosine",
    )
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def run_cli(config_path):
    return subprocess.run(
        [sys.executable, "-m", "opd.cli", "train", str(config_path), "--no-progress"],
        capture_output=True,
        text=True,
        check=True,
    )


def kill_after_rows(config_path, metrics, rows: int, timeout_s: float) -> None:
    """Run ``opd train config_path`` and SIGKILL it once ``metrics`` holds ``rows`` rows."""
    process = subprocess.Popen(
        [sys.executable, "-m", "opd.cli", "train", str(config_path), "--no-progress"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= rows:
            break
        time.sleep(0.005)
    os.kill(process.pid, signal.SIGKILL)
    process.wait()


def killed_and_resumed(config: dict, tmp_path, timeout_s: float = 120) -> list[dict]:
    """``config`` run as ``killed``: SIGKILLed after 5 metrics rows (mid-run, past a checkpoint),
    then the same command again; the rows it ends with."""
    config_path = write_config(config, tmp_path, "killed")
    metrics = tmp_path / "killed" / "metrics.jsonl"
    kill_after_rows(config_path, metrics, 5, timeout_s=timeout_s)
    assert len(metrics.read_text().splitlines()) < STEPS, (
        "the run finished before it could be killed"
    )
    assert 0 < list_checkpoints(tmp_path / "killed")[-1].step < STEPS
    run_cli(config_path)
    return read_jsonl(metrics)


def test_sigkill_mid_run_then_resume_matches_an_uninterrupted_run(
    base_config, tmp_path, char_tokenizer
):
    """With a second dataset of multi-turn episodes (``retry``), played by a student that ends its
    turns early: each turn's draws depend on (seed, step, row, turn) only; the task's rewards (the
    grader's, the environment's) join the advantages beside the teacher's KL."""
    graded = tmp_path / "graded.jsonl"
    lines = [
        {"prompt": f"reverse {w}", "answer": w[::-1]} for w in ("abc", "hgf", "dcea", "bbad", "gah")
    ]
    graded.write_text("".join(json.dumps(line) + "\n" for line in lines))
    base_config["datasets"][0]["source"] = str(graded)
    base_config["training"]["reward_coef"] = 1.0
    quick = tmp_path / "quick_student"
    quick_to_stop(tiny_llama(len(char_tokenizer), seed=1)).save_pretrained(quick)
    char_tokenizer.save_pretrained(quick)
    base_config["student"]["model"] = str(quick)
    retry = {"name": "retry", "max_turns": 2, "max_episode_tokens": 80}
    base_config["datasets"].append(
        dict(base_config["datasets"][0], name="retry", env=retry, num_prompts=6)
    )
    run_cli(write_config(base_config, tmp_path, "reference"))
    reference = read_jsonl(tmp_path / "reference" / "metrics.jsonl")
    assert [r["step"] for r in reference] == list(range(STEPS))
    assert max(row["episode/turns"] for row in reference) > 1
    assert "advantage/reward_abs_mean" in reference[0]  # the reward is in the advantages

    config_path = write_config(base_config, tmp_path, "killed")
    metrics = tmp_path / "killed" / "metrics.jsonl"
    kill_after_rows(config_path, metrics, 5, timeout_s=120)
    rows_at_kill = len(metrics.read_text().splitlines())
    assert rows_at_kill < STEPS, "the run finished before it could be killed"
    last = list_checkpoints(tmp_path / "killed")[-1].step
    assert 0 < last < STEPS

    run_cli(config_path)
    resumed = read_jsonl(metrics)
    assert_same_rows(resumed, reference)  # no step lost, none done twice, same numbers
    assert list_checkpoints(tmp_path / "killed")[-1].step == STEPS


def test_finished_run_is_not_redone_and_can_be_extended(base_config, tmp_path):
    config = dict(base_config, save_every=0)
    train(config_from_dict(config), progress=False)
    records = list_checkpoints(tmp_path / "run")
    assert [r.step for r in records] == [2]  # only the final one
    again = train(config_from_dict(config), progress=False)
    assert again.metrics == [] and len(read_jsonl(tmp_path / "run" / "metrics.jsonl")) == 2
    config["training"] = dict(config["training"], max_steps=3)
    extended = train(config_from_dict(config), progress=False)
    assert [m["step"] for m in extended.metrics] == [2]
    assert [r["step"] for r in read_jsonl(tmp_path / "run" / "metrics.jsonl")] == [0, 1, 2]


def test_half_written_checkpoint_is_ignored_with_a_warning(base_config, tmp_path):
    config = dict(base_config, save_every=1)
    config["training"] = dict(config["training"], max_steps=1)
    train(config_from_dict(config), progress=False)
    staging = tmp_path / "run" / "checkpoints" / ".tmp-step_000002"
    (staging / "model").mkdir(parents=True)
    (staging / "trainer_state.pt").write_bytes(b"partial")
    config["training"]["max_steps"] = 2
    with pytest.warns(UserWarning, match=r"ignoring half-written checkpoint .*\.tmp-step_000002"):
        result = train(config_from_dict(config), progress=False)
    assert [m["step"] for m in result.metrics] == [1]


def test_corrupt_checkpoint_names_the_file_and_offers_the_older_one(base_config, tmp_path):
    config = dict(base_config, save_every=1)
    train(config_from_dict(config), progress=False)
    state = tmp_path / "run" / "checkpoints" / "step_000002" / "trainer_state.pt"
    state.write_bytes(state.read_bytes()[:100])
    config["training"] = dict(config["training"], max_steps=3)
    with pytest.raises(
        CheckpointError, match=r"step_000002/trainer_state\.pt is corrupt.*step_000001 \(step 1\)"
    ):
        Trainer(config_from_dict(config), progress=False).run()


def test_resume_refuses_a_changed_run_and_names_the_field(base_config, tmp_path, model_dirs):
    train(config_from_dict(base_config), progress=False)
    changed = dict(
        base_config, student=dict(base_config["student"], model=str(model_dirs["teacher"]))
    )
    with pytest.raises(ConfigError, match=r"student\.model: differs from the run being resumed"):
        Trainer(config_from_dict(changed), progress=False).run()
    reseeded = dict(base_config, seed=1)
    with pytest.raises(ConfigError, match=r"^seed: differs"):
        Trainer(config_from_dict(reseeded), progress=False).run()


def test_fail_and_overwrite_policies(base_config, tmp_path):
    train(config_from_dict(base_config), progress=False)
    with pytest.raises(
        ConfigError, match=r"log_path: .* already holds a run and on_existing_log_path is 'fail'"
    ):
        Trainer(
            config_from_dict(dict(base_config, on_existing_log_path="fail")), progress=False
        ).run()
    fresh = train(
        config_from_dict(dict(base_config, on_existing_log_path="overwrite")), progress=False
    )
    assert [m["step"] for m in fresh.metrics] == [0, 1]
    assert len(read_jsonl(tmp_path / "run" / "metrics.jsonl")) == 2


def test_log_path_that_is_a_file_is_refused_before_training(base_config, tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match=r"log_path: '.*file' exists and is not a directory"):
        Trainer(
            config_from_dict(dict(base_config, log_path=str(tmp_path / "file"))), progress=False
        ).run()


def test_load_checkpoint_path_takes_weights_with_a_fresh_optimizer(base_config, tmp_path):
    first, second = trained_and_loading(base_config, tmp_path)
    trainer = Trainer(config_from_dict(second), progress=False)
    original = AutoModelForCausalLM.from_pretrained(base_config["student"]["model"]).state_dict()
    trainer.parts.config.training.max_steps = trainer.parts.num_steps = 0
    trainer.run()
    loaded = trainer.parts.student.state_dict()
    for name, value in first.student.state_dict().items():
        torch.testing.assert_close(loaded[name], value)
    assert any(not torch.equal(original[k], loaded[k]) for k in loaded)
    assert trainer.parts.optimizer.state_dict()["state"] == {}
    assert (
        json.loads((tmp_path / "run" / "checkpoints.jsonl").read_text().splitlines()[-1])["step"]
        == 2
    )


def test_a_resumed_run_keeps_the_objective_and_learning_rate_it_recorded_where_the_config_sets_none(
    base_config, tmp_path
):
    """A run begun under other defaults continues as it began: the rows after resuming from a
    config that names neither equal those of the same run uninterrupted."""
    named = dict(base_config, save_every=2, log_path=str(tmp_path / "whole"))
    named["training"] = dict(
        base_config["training"], objective="sampled_reverse_kl", learning_rate=1e-2, max_steps=4
    )
    whole = train(config_from_dict(named), progress=False).metrics
    first_half = dict(named, log_path=str(tmp_path / "split"))
    first_half["training"] = dict(named["training"], max_steps=2)
    train(config_from_dict(first_half), progress=False)
    unset = dict(first_half)
    unset["training"] = {
        key: value
        for key, value in named["training"].items()
        if key not in ("objective", "learning_rate")
    }
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resumed = config_from_dict(unset)
    said = [str(w.message) for w in caught]
    assert any(
        "training.learning_rate 0.01, as recorded" in m and "default is 3e-05" in m for m in said
    )
    assert any("'sampled_reverse_kl'" in m and "'topk_forward_kl'" in m for m in said)
    assert (resumed.training.objective.name, resumed.training.learning_rate) == (
        "sampled_reverse_kl",
        1e-2,
    )
    train(resumed, progress=False)
    split = read_jsonl(tmp_path / "split" / "metrics.jsonl")
    assert [row["progress/done_frac"] for row in split] == [
        0.5,
        1.0,
        0.75,
        1.0,
    ]  # of 2, then of 4 steps
    assert_same_rows(
        *([dict(row, **{"progress/done_frac": 0}) for row in rows] for rows in (split, whole))
    )
    recorded = yaml.safe_load((tmp_path / "split" / "config.yaml").read_text())["training"]
    assert (recorded["objective"]["name"], recorded["learning_rate"]) == (
        "sampled_reverse_kl",
        1e-2,
    )
    fresh = config_from_dict(dict(unset, on_existing_log_path="overwrite")).training
    assert (fresh.objective.name, fresh.learning_rate) == ("topk_forward_kl", 3e-5)


def test_a_resumed_run_keeps_the_batch_shape_it_recorded_where_the_config_sets_none(
    base_config, tmp_path
):
    first = dict(base_config, log_path=str(tmp_path / "run"))
    first["training"] = dict(base_config["training"], max_steps=1)
    train(config_from_dict(first), progress=False)  # 2 prompts x 2 samples, as base_config sets
    unset = dict(first, datasets=[dict(base_config["datasets"][0])])
    for key in ("groups_per_batch", "group_size"):
        del unset["datasets"][0][key]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resumed = config_from_dict(unset).datasets[0]
    said = [str(w.message) for w in caught]
    assert (resumed.groups_per_batch, resumed.group_size) == (2, 2)
    assert any("datasets[0].group_size 2, as recorded" in m and "default is 1" in m for m in said)
    fresh = config_from_dict(dict(unset, on_existing_log_path="overwrite")).datasets[0]
    assert (fresh.groups_per_batch, fresh.group_size) == (16, 1)


def test_only_the_first_torchrun_worker_says_a_resumed_run_keeps_its_recorded_settings(
    base_config, tmp_path, monkeypatch
):
    first = dict(base_config, log_path=str(tmp_path / "run"))
    first["training"] = dict(base_config["training"], learning_rate=1e-2, max_steps=1)
    train(config_from_dict(first), progress=False)
    unset = dict(first)
    unset["training"] = {k: v for k, v in first["training"].items() if k != "learning_rate"}
    said = {}
    for rank in ("0", "1"):
        monkeypatch.setenv("RANK", rank)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            kept = config_from_dict(unset).training.learning_rate
        assert kept == 1e-2  # every worker keeps the recorded rate
        said[rank] = [str(w.message) for w in caught if "as recorded" in str(w.message)]
    assert len(said["0"]) == 1 and said["1"] == []


def test_sigkill_with_collection_ahead_then_resume_matches_an_uninterrupted_run(
    base_config, tmp_path
):
    """``max_staleness: k`` (2 here: two versions in flight): each checkpoint keeps the weights its
    batches in collection were handed (k older versions), and the resumed run collects those steps
    from them again: every row equals the uninterrupted run's, staleness included (a resume that
    sampled them from the checkpoint's weights would log staleness 0, 1, ... after it)."""
    staleness = 2
    base_config["training"]["max_staleness"] = staleness
    run_cli(write_config(base_config, tmp_path, "reference"))
    reference = read_jsonl(tmp_path / "reference" / "metrics.jsonl")
    assert [r["staleness_mean"] for r in reference] == [min(s, staleness) for s in range(STEPS)]

    config_path = write_config(base_config, tmp_path, "killed")
    metrics = tmp_path / "killed" / "metrics.jsonl"
    kill_after_rows(config_path, metrics, 5, timeout_s=120)
    assert len(metrics.read_text().splitlines()) < STEPS, (
        "the run finished before it could be killed"
    )
    checkpoint = list_checkpoints(tmp_path / "killed")[-1]
    assert 2 <= checkpoint.step < STEPS
    saved = sorted(p.name for p in (checkpoint.path / "in_flight").glob("*.safetensors"))
    assert len(saved) == min(staleness, STEPS - checkpoint.step)  # one version a step in flight

    run_cli(config_path)
    assert_same_rows(read_jsonl(metrics), reference)
