"""The real-model recipes in examples/, checked as a user checks them before renting GPUs: ``opd
train RECIPE --dry-run`` resolves each, fits it to its processes and prints the plan, with the
models' sizes from their config files alone (a Hugging Face cache holding only those, on a machine
without the hub: tests/hub_configs.py), equal to the counts worked out by hand from the configs,
and the memory per device that follows from them. The vLLM recipes are checked in the vLLM suite
(a sampler: vllm config needs vLLM installed)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.hub_configs import hub_cache, lora_parameters, parameters
from tests.servers import free_port

ROOT = Path(__file__).parents[1]


def dry_run(recipe: str, cache: Path, *args: str) -> str:
    env = os.environ | {
        "HF_HUB_CACHE": str(cache),
        "HF_ENDPOINT": f"http://127.0.0.1:{free_port()}",
    }
    command = [
        sys.executable,
        "-m",
        "opd",
        "train",
        str(ROOT / "examples" / recipe),
        "--dry-run",
        *args,
    ]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    return done.stdout


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return hub_cache(tmp_path_factory.mktemp("hub-cache"))


def line(output: str, label: str) -> str:
    (found,) = [text for text in output.splitlines() if text.startswith(label)]
    return found


def test_the_laptop_recipe_plans_two_smollm2_models_in_float32_on_one_cpu_process(cache):
    output = dry_run("smollm2_cpu.yaml", cache)
    student, teacher = "HuggingFaceTB/SmolLM2-135M-Instruct", "HuggingFaceTB/SmolLM2-360M-Instruct"
    assert line(output, "processes").split() == ["processes", "1"]
    lora = lora_parameters(student, 32)
    lora_text = f"LoRA rank 32: {lora:,} (9.8M) trained"
    assert f"{student}: {parameters(student):,} (134.5M) parameters, float32, {lora_text}" in output
    assert (
        f"{teacher}: {parameters(teacher):,} (361.8M) parameters, float32, a whole copy" in output
    )
    weights, gradients, adam = (
        (parameters(student) + lora) * 4 / 1e9,
        lora * 4 / 1e9,
        2 * lora * 4 / 1e9,
    )
    total = weights + gradients + adam
    assert line(output, "  student").endswith(
        f"{total:.2f} GB: weights {weights:.2f} + gradients {gradients:.2f} + AdamW {adam:.2f}"
    )
    assert line(output, "  teacher").endswith(f"{parameters(teacher) * 4 / 1e9:.2f} GB: weights")
    assert "per step       32 sequences (32 per process), up to 48 tokens each" in output
    # activations a token, by hand: 30 layers x (16 x 576 + 6 x 1536 + 4 x 3 x 64 + LoRA 7 x 576) x
    # 4 B
    assert "~2.79 MB of activations a token" in line(output, "micro-batches")
    assert line(output, "micro-batches").endswith("packed")


def test_the_disaggregated_recipe_plans_fsdp_over_four_processes_and_two_servers(cache):
    output = dry_run("rollout_servers_8gpu.yaml", cache, "--nproc", "4")
    student = "Qwen/Qwen3-1.7B"
    assert line(output, "processes").split()[:2] == ["processes", "4"]
    assert (
        f"{student}: {parameters(student):,} (1.72B) parameters, bfloat16, full fine-tune, "
        "FSDP2-sharded" in output
    )
    assert "Qwen/Qwen3-8B on http://127.0.0.1:8200/v1 (openai server: no memory here)" in output
    # bfloat16 weights and gradients; float32 AdamW moments and master weights: a quarter per
    # process
    share = parameters(student) * 2 / 4 / 1e9
    assert line(output, "  student").endswith(
        f"{8 * share:.2f} GB: weights {share:.2f} + gradients {share:.2f} + AdamW with float32 "
        f"master weights {6 * share:.2f}"
    )


def test_a_recipe_that_does_not_fit_its_processes_is_refused_by_the_dry_run(cache):
    env = os.environ | {
        "HF_HUB_CACHE": str(cache),
        "HF_ENDPOINT": f"http://127.0.0.1:{free_port()}",
    }
    recipe = ROOT / "examples" / "rollout_servers_8gpu.yaml"
    command = [sys.executable, "-m", "opd", "train", str(recipe), "--dry-run", "--nproc", "3"]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 2
    assert "into world size (3)" in done.stderr and "Traceback" not in done.stderr
