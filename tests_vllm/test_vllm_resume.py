"""Exact resume with the vLLM sampler: a run killed with SIGKILL and run again matches an uninterrupted
one, because every row samples from a seed derived from (run seed, step, row), and with collection
ahead because the checkpoint keeps the weights its batches in collection were handed."""

from __future__ import annotations

import pytest

from opd.runs.metrics import read_jsonl
from tests.test_resume import STEPS, assert_same_rows, killed_and_resumed, run_cli, write_config


@pytest.mark.parametrize("staleness", [0, 1])
def test_sigkill_mid_run_then_resume_matches_an_uninterrupted_run(vllm_config, tmp_path, staleness):
    vllm_config["training"]["max_staleness"] = staleness
    run_cli(write_config(vllm_config, tmp_path, "reference"))
    reference = read_jsonl(tmp_path / "reference" / "metrics.jsonl")
    assert [r["step"] for r in reference] == list(range(STEPS))
    if not staleness:
        assert max(abs(r["kl_sample_train"]) for r in reference) < 1e-3
    else:
        assert [r["staleness_mean"] for r in reference] == [min(s, staleness) for s in range(STEPS)]

    resumed = killed_and_resumed(vllm_config, tmp_path, timeout_s=300)
    assert_same_rows(resumed, reference)  # same samples, same numbers, within 1e-6
