"""The GPU recipes with a vLLM sampler, checked by their dry run as a user would before renting the
GPUs, with real vLLM deciding whether their engines can be built: the models' config files only
(tests/hub_configs.py, no weights, no hub), the parameter counts equal to the counts by hand, the
layout fitted to the processes. vLLM on this CPU has no sleep mode, which the 8-GPU recipe turns on:
it is overridden here, and only here."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.hub_configs import hub_cache, lora_parameters, parameters

ROOT = Path(__file__).parents[1]


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return hub_cache(tmp_path_factory.mktemp("hub-cache"))


def dry_run(recipe: str, cache: Path, *args: str) -> subprocess.CompletedProcess:
    env = os.environ | {"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    command = [
        sys.executable,
        "-m",
        "opd",
        "train",
        str(ROOT / "examples" / recipe),
        "--dry-run",
        *args,
    ]
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)


def test_the_8gpu_thinking_recipe_fits_six_training_processes_and_a_teacher_server(cache):
    done = dry_run(
        "qwen3_8b_to_1.7b_8gpu.yaml",
        cache,
        "--nproc",
        "6",
        "student.sampler_options.enable_sleep_mode=false",
    )
    assert done.returncode == 0, done.stderr[-3000:]
    student = "Qwen/Qwen3-1.7B"
    assert (
        f"{student}: {parameters(student):,} (1.72B) parameters, bfloat16, full fine-tune, FSDP2"
        in done.stdout
    )
    assert "Qwen/Qwen3-8B on http://127.0.0.1:8200/v1 (openai server" in done.stdout
    assert "per step       192 sequences (32 per process), up to 8192 tokens each" in done.stdout
    share = parameters(student) * 2 / 6 / 1e9
    assert (
        f"{8 * share:.2f} GB: weights {share:.2f} + gradients {share:.2f} + "
        f"AdamW with float32 master weights {6 * share:.2f}" in done.stdout
    )
    on_five = dry_run("qwen3_8b_to_1.7b_8gpu.yaml", cache, "--nproc", "5")
    # 48 groups do not split in 5
    assert on_five.returncode == 2 and "into world size (5)" in on_five.stderr


def test_the_one_gpu_lora_recipe_holds_both_models_and_an_engine(cache):
    done = dry_run("qwen3_1.7b_lora_1gpu.yaml", cache)
    assert done.returncode == 0, done.stderr[-3000:]
    student, teacher = "Qwen/Qwen3-1.7B", "Qwen/Qwen3-8B"
    lora = lora_parameters(student, 32)
    assert f"LoRA rank 32: {lora:,} (34.9M) trained, one process" in done.stdout
    assert (
        f"{teacher}: {parameters(teacher):,} (8.19B) parameters, bfloat16, a whole copy"
        in done.stdout
    )
    # bfloat16 base weights; the adapter, its gradients and AdamW moments in float32 (PEFT's
    # default)
    weights, gradients, adam = (
        (parameters(student) * 2 + lora * 4) / 1e9,
        lora * 4 / 1e9,
        2 * lora * 4 / 1e9,
    )
    assert f"weights {weights:.2f} + gradients {gradients:.2f} + AdamW {adam:.2f}" in done.stdout
    assert f"  teacher      {parameters(teacher) * 2 / 1e9:.2f} GB: weights" in done.stdout
    assert "  vllm         0.25 of a GPU's memory" in done.stdout


def test_the_readme_commands_whose_student_samples_with_vllm_resolve(monkeypatch):
    from opd.config import load_config
    from tests.test_readme import config_commands, samples_with_vllm

    monkeypatch.chdir(ROOT)
    commands = [
        (config, overrides) for config, overrides in config_commands() if samples_with_vllm(config)
    ]
    assert commands, "the README shows a vLLM recipe"
    for config, overrides in commands:
        assert load_config(config, overrides).student.sampler == "vllm"
