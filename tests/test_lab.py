"""bench/lab.py --tiny, the fast lab's smoke run, on every CI run: every method trains through
opd's own trainer on a task whose models the run builds itself, and the FLOPs it reports are the
phases each method pays for, recomputed here from the counts the result file records."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

PHASES = {  # per token: (student forward-equivalents, teacher forward-equivalents), 2N FLOPs each
    "opd-topk": (4, 1),  # the student samples (1) and updates (3), the teacher scores (1)
    "opd-rkl": (4, 1),
    "defaults": (4, 1),
    "rl+kl": (4, 1),
    "rl": (4, 0),  # the reward alone: the teacher's scores are not used
    "sft-teacher": (3, 1),  # the teacher writes, the student updates
    "sft-truth": (3, 0),  # the dataset writes
}


@pytest.fixture(scope="module")
def lab_result(tmp_path_factory):
    root = tmp_path_factory.mktemp("lab")
    out = root / "lab.json"
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "lab.py"), "--tiny", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        env=os.environ | {"OPD_CACHE": str(root / "cache")},  # the models are built, not found
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return json.loads(out.read_text()), done.stdout


def test_every_method_trains_and_is_evaluated(lab_result):
    record, printed = lab_result
    runs = record["results"]
    assert {run["method"] for run in runs} == set(PHASES)
    teacher = record["teacher_accuracy"]["chain"]
    for run in runs:
        assert [point["step"] for point in run["curve"]] == [0, 3, 6], run["method"]
        assert len(run["steps"]) == 6
        assert run["curve"][0]["accuracy"] < teacher  # the student starts below its teacher
        assert (
            run["config"]["student"]["model"] == "lab-v2-tiny/chain/student"
        )  # no path of this machine
    starts = {run["curve"][0]["accuracy"] for run in runs}
    assert (
        len(starts) == 1
    )  # one student, one held-out set, greedy: the same start for every method
    assert "FLOPs to 60% of the teacher" in printed


def test_the_flops_are_the_phases_each_method_pays_for(lab_result):
    record, _ = lab_result
    for run in record["results"]:
        student, teacher = PHASES[run["method"]]
        per_token = 2 * (
            student * run["parameters"]["student"] + teacher * run["parameters"]["teacher"]
        )
        expected = 0.0
        for point, step in zip(run["curve"][1:], run["steps"][2::3], strict=True):
            assert step["step"] == point["step"] - 1
        for step in run["steps"]:
            tokens = step["num_sequences"] * (run["prompt_tokens"] + step["completion_len_mean"])
            expected += per_token * tokens
        assert run["curve"][-1]["flops"] == pytest.approx(expected, rel=1e-9), run["method"]
