"""Exact resume with the vLLM sampler and collection ahead: a run killed with SIGKILL and run again
matches an uninterrupted one, because every row samples from a seed derived from (run seed, step,
row) and the checkpoint keeps the weights its batches in collection were handed. (Resume without
collection ahead is test_vllm_distributed's killed process: the same seeds, on two processes.)"""

from __future__ import annotations

from opd.runs.metrics import read_jsonl
from tests.test_resume import STEPS, assert_same_rows, killed_and_resumed, run_cli, write_config


def test_sigkill_mid_run_with_collection_ahead_then_resume_matches_an_uninterrupted_run(
    vllm_config, tmp_path
):
    vllm_config["training"]["max_staleness"] = 1
    run_cli(write_config(vllm_config, tmp_path, "reference"))
    reference = read_jsonl(tmp_path / "reference" / "metrics.jsonl")
    assert [r["step"] for r in reference] == list(range(STEPS))
    assert [r["staleness_mean"] for r in reference] == [min(s, 1) for s in range(STEPS)]

    resumed = killed_and_resumed(vllm_config, tmp_path, timeout_s=300)
    assert_same_rows(resumed, reference)  # same samples, same numbers, within 1e-6
