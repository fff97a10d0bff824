"""Timing spans, the Chrome trace, and the HTML report of a short real run."""

import json
from html.parser import HTMLParser

import pytest

from opd.cli import main
from opd.config import config_from_dict
from opd.demo.run import demo_config
from opd.runs.metrics import read_jsonl
from opd.trainer.loop import train


class Collector(HTMLParser):
    def __init__(self):
        super().__init__()
        self.images, self.captions, self.rows, self._in_caption = [], [], 0, False
        self.text = []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "img":
            self.images.append(attrs)
        self._in_caption = tag == "figcaption"
        self.rows += tag == "tr"

    def handle_data(self, data):
        self.text.append(data)
        if self._in_caption:
            self.captions.append(data)

    def handle_endtag(self, tag):
        self._in_caption = False


@pytest.fixture(scope="module")
def finished_run(demo_models, tmp_path_factory):
    log_path = tmp_path_factory.mktemp("report") / "run"
    config = demo_config(str(log_path), demo_models["student"], demo_models["teacher"], 6, 0)
    config |= {"eval_every": 3, "save_every": 3, "trace": True}
    config["datasets"][0]["eval_num_prompts"] = 8
    train(config_from_dict(config), progress=False)
    return log_path


def test_every_phase_is_timed(finished_run):
    names = {span["name"] for span in read_jsonl(finished_run / "timing.jsonl")}
    assert names == {"sample", "teacher", "train", "eval", "checkpoint"}
    rows = [json.loads(line) for line in (finished_run / "metrics.jsonl").read_text().splitlines()]
    assert all(
        row["time/total"] >= row["time/sample"] + row["time/teacher"] + row["time/train"] - 1e-6
        for row in rows
        if "loss" in row
    )
    assert any("time/checkpoint" in row for row in rows) and any("time/eval" in row for row in rows)


def test_chrome_trace_has_a_complete_event_per_span(finished_run, tmp_path):
    trace = json.loads((finished_run / "trace.json").read_text())
    complete = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(complete) == len(read_jsonl(finished_run / "timing.jsonl"))
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in complete)
    assert main(["trace", str(finished_run), "--out", str(tmp_path / "t.json")]) == 0
    assert json.loads((tmp_path / "t.json").read_text()) == trace


def test_report_parses_and_names_every_curve(finished_run, tmp_path):
    out = tmp_path / "report.html"
    assert main(["report", str(finished_run), "--out", str(out), "--steps", "0", "5"]) == 0
    page = Collector()
    page.feed(out.read_text())
    captions = set(page.captions)
    for title in (
        "Teacher KL (training batches)",
        "Objective",
        "Held-out accuracy",
        "Held-out teacher KL",
        "Entropy and health checks",
        "Group diversity",
        "Reward",
        "Teacher KL at the answer and before it",
        "The teacher's view of the student's tokens",
        "Time per phase",
    ):
        assert title in captions, title
    assert any(c.startswith("Timeline of step") for c in captions)
    assert all(img["src"].startswith("data:image/png;base64,") for img in page.images)
    assert len(page.images) == 11 and len(list((tmp_path / "report_files").glob("*.png"))) == 11
    text = "".join(page.text)
    rows = [row for row in read_jsonl(finished_run / "metrics.jsonl") if "loss" in row]
    first, last = rows[0]["group/distinct"], rows[-1]["group/distinct"]
    assert f"{first:.3g} → {last:.3g}: share of distinct completions in a group" in text
    for key in ("reward/mean", "entropy", "teacher_kl/answer", "diag/first_wrong_teacher_prob"):
        assert f"{key}" in text and all(key in row for row in rows), key
    first_sample = json.loads((finished_run / "samples.jsonl").read_text().splitlines()[0])
    assert "test/reverse/accuracy (8 held-out prompts, greedy): first evaluation, last" in text
    assert "teacher_kl on the training batches (the student's samples): first step, last" in text
    assert first_sample["prompt"] in text
    assert "so a sample's mean can be below zero" in text
    assert page.rows >= 2 + 4  # summary rows and sample rows for steps 0 and 5


def test_report_of_a_missing_run(tmp_path, capsys):
    assert main(["report", str(tmp_path / "nothing")]) == 2
    assert "no metrics.jsonl" in capsys.readouterr().err


def test_a_curve_that_repeats_another_is_drawn_once():
    from opd.runs.figures import distinct

    curves = {
        "teacher_kl": ([0, 1], [0.5, 0.4]),
        "teacher_kl/rev": ([0, 1], [0.5, 0.4]),
        "x": ([0], [1.0]),
    }
    assert list(distinct(curves)) == ["teacher_kl", "x"]


def test_the_time_plot_smooths_with_a_trailing_mean():
    from opd.runs.figures import smoothed

    assert smoothed([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]
    assert smoothed([2.0, 4.0], 1) == [2.0, 4.0]


def test_the_summary_names_the_objective_of_each_source(tmp_path):
    from opd.runs.report import _summary
    from opd.runs.resume import CONFIG_NAME

    training = {
        "objective": {"name": "sampled_reverse_kl"},
        "off_policy_objective": {"name": "nll"},
        "data_source": "mixed",
    }
    (tmp_path / CONFIG_NAME).write_text(json.dumps({"training": training}))
    text = _summary(tmp_path, [], [])
    assert "<td>sampled_reverse_kl; on the teacher&#x27;s steps nll / mixed</td>" in text


def test_what_to_try_replays_the_watchdog_over_the_run():
    from opd.runs.diagnosis import what_to_try

    constant = {"loss": 0.1, "reward/constant_groups": 1.0, "advantage/reward_abs_mean": 0.0}
    rows = [{"step": step} | constant for step in range(6)]
    (advice,) = what_to_try(rows)
    assert advice.startswith("step 4: every group's samples got the same reward for 5 steps")
    assert "training.data_source: mixed" in advice
    rows[2]["reward/constant_groups"] = 0.5  # one step with a signal: no five in a row
    assert what_to_try(rows) == []
    sampled = {
        "training": {"reward_coef": 0.0},
        "datasets": [{"groups_per_batch": 8, "group_size": 4}],
    }
    (shape,) = what_to_try(rows, sampled)
    assert "datasets[0] samples 4 completions of each of 8 prompts" in shape
    assert "groups_per_batch: 32, group_size: 1" in shape
    rewarded = {
        "training": {"reward_coef": 1.0},
        "datasets": [{"groups_per_batch": 8, "group_size": 4}],
    }
    assert what_to_try(rows, rewarded) == []  # a reward compares the samples of a group
    single = {"training": {}, "datasets": [{"groups_per_batch": 16, "group_size": 1}]}
    assert what_to_try(rows, single) == []
