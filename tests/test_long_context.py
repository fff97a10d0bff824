"""bench/long_context.py --tiny on every CI run: one opd step (sample, score, update with and
without gradient checkpointing) at three completion lengths spanning 4x, each phase's peak memory
measured in a process of its own; past a few hundred tokens no phase grows by a (tokens x
vocabulary) tensor."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VOCAB_ROW_BYTES = 151_936 * 4


def test_the_tiny_long_context_run_measures_every_phase_and_no_tokens_x_vocabulary_tensor(tmp_path):
    out = tmp_path / "long.json"
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "long_context.py"),
            "--tiny",
            "--out",
            str(out),
            "--models",
            str(tmp_path / "models"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        env=os.environ | {"OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    record = json.loads(out.read_text())
    rows = record["results"]
    assert {row["tokens"] for row in rows if row["phase"] != "sample"} == {128, 256, 512}
    assert {(row["phase"], row["checkpointing"]) for row in rows} == {
        ("sample", False),
        ("score", False),
        ("update", False),
        ("update", True),
    }
    assert all(
        row["peak_bytes"] > 0 and row["seconds"] > 0 for row in rows if row["phase"] != "sample"
    )
    for label, found in record["summary"].items():
        slopes = found["bytes_per_token_slopes"]
        assert (
            len(slopes) == 2 and found["last_slope_over_vocab_row"] == slopes[-1] / VOCAB_ROW_BYTES
        )
        assert found["last_slope_over_vocab_row"] < 0.25, (label, slopes)  # a (T x V) tensor: >= 1
