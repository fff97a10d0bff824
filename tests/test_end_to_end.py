"""The demo pipeline from scratch: real models trained on the built-in task, then distilled."""

import pytest

import opd.demo.run as demo
from opd.cli import main
from opd.demo.run import DemoModelSpec, ensure_model, gap_summary, run_demo


def test_distillation_lowers_teacher_kl_and_raises_accuracy(demo_models, tmp_path, monkeypatch):
    monkeypatch.setenv("OPD_CACHE", demo_models["cache"])
    lines: list[str] = []
    results = run_demo(log_path=str(tmp_path / "run"), steps=200, seed=0, log=lines.append)
    before, after, teacher = results["student before"], results["student after"], results["teacher"]
    assert teacher["accuracy"] >= 0.95
    assert 0.3 <= before["accuracy"] <= 0.8  # the student starts clearly below the teacher
    assert after["teacher_kl"] < 0.6 * before["teacher_kl"]
    assert after["accuracy"] >= before["accuracy"] + 0.15
    assert any("closed" in line for line in lines)
    assert (tmp_path / "run" / "metrics.jsonl").exists()


def test_a_student_short_of_its_target_is_saved_with_a_warning(tmp_path, monkeypatch):
    monkeypatch.setenv("OPD_CACHE", str(tmp_path))
    unreachable = DemoModelSpec(
        hidden_size=16, num_layers=1, sft_steps=4, sft_learning_rate=1e-3, target_accuracy=1.0
    )
    lines: list[str] = []
    directory = ensure_model("student", unreachable, seed=0, log=lines.append)
    assert (directory / "model.safetensors").exists()
    assert "4 supervised steps" in lines[1]
    assert lines[2].startswith("  warning: the student reached") and "short of the 100%" in lines[2]


def test_the_gap_summary_by_hand():
    assert gap_summary(1.0, 0.6, 0.9) == "the student closed 75% of its accuracy gap to the teacher"
    fell = gap_summary(1.0, 0.6, 0.5)
    assert fell.startswith("the student fell 10.0 points further behind the teacher")
    assert "--steps" in fell and "lower --lr" in fell
    assert gap_summary(0.5, 0.6, 0.9) == ""


def test_demo_lr_flag_reaches_the_run_config(monkeypatch):
    calls = []
    monkeypatch.setattr(demo, "run_demo", lambda **kwargs: calls.append(kwargs))
    assert main(["demo", "--lr", "2.5e-4", "--steps", "7"]) == 0
    assert main(["demo"]) == 0
    assert [(c["learning_rate"], c["steps"]) for c in calls] == [(2.5e-4, 7), (5e-4, 400)]
    config = demo.demo_config("runs/x", "student", "teacher", steps=7, seed=0, learning_rate=2.5e-4)
    assert config["training"]["learning_rate"] == 2.5e-4


def test_demo_refuses_a_zero_or_negative_step_count_or_rate(capsys):
    for argv in (["demo", "--steps", "0"], ["demo", "--lr", "-0.001"], ["demo", "--steps", "x"]):
        with pytest.raises(SystemExit):
            main(argv)
    errors = capsys.readouterr().err
    assert "--steps: must be > 0, got 0" in errors and "--lr: must be > 0, got -0.001" in errors
    assert "--steps: invalid int value: 'x'" in errors
