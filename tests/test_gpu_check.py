"""bench/gpu_check.py, the script a GPU machine runs, run here in its CPU mode on every CI run so
that it cannot rot before a GPU is there: every section runs, and the equalities hold in float32."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_section_runs_on_the_cpu_and_its_equalities_hold(tmp_path):
    out = tmp_path / "gpu_check.json"
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "gpu_check.py"),
            "--cpu",
            "--tiny",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=os.environ | {"OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    record = json.loads(out.read_text())
    results = record["results"]
    assert (
        record["command"].startswith("python bench/gpu_check.py")
        or "gpu_check" in record["command"]
    )
    packing = results["packing"]
    assert packing["equal"] and packing["max_abs_difference"] <= 1e-4
    # two paths for real: packed forwards see the rows' 233 tokens (12 + 48 + 20 + 33 + 48 + 5 + 40
    # + 27), padded ones the 8 rows at their full 48 columns (when both ran packed, both saw 233)
    assert (packing["packed_forward_tokens"], packing["padded_forward_tokens"]) == (233, 8 * 48)
    assert packing["packed"] and packing["padded"] and packing["tokens"] == 233
    assert packing["packed_seconds"] > 0 and packing["padded_seconds"] > 0
    assert results["teacher"]["tokens_per_s"] > 0
    assert [s["batch"] for s in results["sampler"]] == [4, 8]
    assert all(
        s["tokens"] == 16 * s["batch"] for s in results["sampler"]
    )  # no stop id: every row to the end
    update = results["update"]
    assert {(u["gradient_checkpointing"], u["micro_batch_tokens"]) for u in update} == {
        (False, 96),
        (False, 384),
        (True, 96),
        (True, 384),
    }
    assert all(u["tokens_per_s"] > 0 and u["estimate_bytes"] > 0 for u in update)
    resume = results["resume"]
    assert resume["equal"] and resume["steps"] == 10 and 0 < resume["killed_after_rows"] < 10
    assert resume["max_abs_kl_sample_train"] < 1e-4
