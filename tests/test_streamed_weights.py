"""The weights a sampler is sent from an FSDP2-sharded student, gathered a bucket at a time: the
same tensors, under the same names, as gathering the whole model, with real processes (torchrun,
gloo)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from opd.policy.parallel.fsdp import buckets

WORKER = Path(__file__).with_name("streamed_weights_worker.py")


def test_buckets_hold_consecutive_units_up_to_the_size_and_an_oversized_unit_alone():
    units = [("a", set(), 10), ("b", set(), 10), ("c", set(), 30), ("d", set(), 5), ("e", set(), 5)]
    grouped = [[name for name, _, _ in bucket] for bucket in buckets(units, 80, 4)]
    assert grouped == [["a", "b"], ["c"], ["d", "e"]]  # 40 + 40 bytes fit 80; c is 120 alone
    assert [[n for n, _, _ in b] for b in buckets(units, 1, 4)] == [
        ["a"],
        ["b"],
        ["c"],
        ["d"],
        ["e"],
    ]
    assert [[n for n, _, _ in b] for b in buckets(units, 10**6, 4)] == [["a", "b", "c", "d", "e"]]


@pytest.mark.parametrize("lora_rank", [0, 4])
def test_streamed_weights_of_a_sharded_student_equal_the_whole_gathered_ones(tmp_path, lora_rank):
    out = tmp_path / "found.json"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            str(WORKER),
            str(out),
            str(lora_rank),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=os.environ | {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(WORKER.parent.parent)},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(out.read_text())
    expected_names = found["names"]
    assert "lm_head.weight" in expected_names and "model.embed_tokens.weight" in expected_names
    if lora_rank:  # merged: plain Hugging Face names, no adapter tensors
        assert not any("lora_" in name or "base_layer" in name for name in expected_names)
    for label in ("one_unit", "all"):
        assert found[label]["names"] == expected_names, label
        assert found[label]["count"] == len(expected_names), label  # each weight once
        assert found[label]["max_difference"] == 0.0, label
