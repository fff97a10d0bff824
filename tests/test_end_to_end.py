"""The demo pipeline from scratch: real models trained on the built-in task, then distilled."""

from opd.demo.run import run_demo


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
