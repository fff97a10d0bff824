"""Tiny random models and tokenizers built from configs: no download, fast on two cores."""

from __future__ import annotations

import json
import os
import warnings

import pytest
import torch
from hypothesis import HealthCheck, settings
from transformers import LlamaConfig, LlamaForCausalLM

from opd.demo.char_tokenizer import build_char_tokenizer

warnings.filterwarnings("ignore", message=".*generation flags are not valid.*")

# ``ci``: the same generated examples on every run, so that CI is reproducible; ``campaign``:
# fresh random examples, many more of them (HYPOTHESIS_PROFILE=campaign, OPD_FUZZ_EXAMPLES=N)
settings.register_profile(
    "ci",
    max_examples=40,
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "campaign",
    max_examples=int(os.environ.get("OPD_FUZZ_EXAMPLES", "2000")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def tiny_llama(
    vocab_size: int, *, hidden: int = 32, layers: int = 2, seed: int = 0, tie: bool = True, **extra
):
    """A randomly initialised Llama small enough for unit tests.

    The large init scale makes the next-token distributions peaked, so two such models
    disagree clearly (the default scale gives near-uniform, near-identical outputs).
    """
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        pad_token_id=0,
        eos_token_id=2,
        bos_token_id=None,
        tie_word_embeddings=tie,
        initializer_range=0.3,
        **{"max_position_embeddings": 256, **extra},
    )
    return LlamaForCausalLM(config).eval()


def quick_to_stop(model, scale: float = 3.0):
    """``model`` with its end-of-turn row of the lm head (id 2) scaled up, so that a random
    model ends most turns within a few tokens: multi-turn episodes in tests get finished turns."""
    with torch.no_grad():
        model.get_output_embeddings().weight[2] *= scale
    return model


@pytest.fixture(scope="session")
def char_tokenizer():
    return build_char_tokenizer()


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory, char_tokenizer):
    """Two saved tiny models sharing the char tokenizer: 'student' and a different 'teacher'."""
    root = tmp_path_factory.mktemp("models")
    paths = {}
    for name, seed in (("student", 1), ("teacher", 2)):
        path = root / name
        tiny_llama(len(char_tokenizer), seed=seed).save_pretrained(path)
        char_tokenizer.save_pretrained(path)
        paths[name] = path
    return paths


@pytest.fixture(scope="session")
def demo_models(tmp_path_factory):
    """The demo's trained teacher and warmed-up student, built once per session."""
    import os

    from opd.demo import run as demo

    previous = os.environ.get("OPD_CACHE")
    os.environ["OPD_CACHE"] = str(tmp_path_factory.mktemp("opd-cache"))
    try:
        teacher = demo.ensure_model("teacher", demo.TEACHER_SPEC, seed=0, log=lambda *_: None)
        student = demo.ensure_model("student", demo.STUDENT_SPEC, seed=1, log=lambda *_: None)
        yield {"teacher": teacher, "student": student, "cache": os.environ["OPD_CACHE"]}
    finally:
        if previous is None:
            os.environ.pop("OPD_CACHE", None)
        else:
            os.environ["OPD_CACHE"] = previous


@pytest.fixture
def prompts_file(tmp_path):
    path = tmp_path / "prompts.jsonl"
    lines = [
        {"prompt": f"reverse {w}", "answer": w[::-1]}
        for w in ("abc", "hgf", "dcea", "bbad", "gah", "fed")
    ]
    lines.append(
        {
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "reverse ab"},
            ]
        }
    )
    lines.append({"messages": [{"role": "user", "content": "reverse cab"}], "answer": "bac"})
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    return path


def trained_and_loading(base_config: dict, tmp_path):
    """Train ``base_config`` (2 steps), then a config for a new run that loads its last
    checkpoint."""
    from opd.config import config_from_dict
    from opd.trainer.loop import train

    first = train(config_from_dict(base_config), progress=False)
    second = dict(
        base_config,
        log_path=str(tmp_path / "second"),
        load_checkpoint_path=str(tmp_path / "run" / "checkpoints" / "step_000002"),
    )
    return first, second


@pytest.fixture
def base_config(model_dirs, prompts_file, tmp_path):
    """A config dict for a 2-step full fine-tune run on the tiny models."""
    return {
        "log_path": str(tmp_path / "run"),
        "seed": 0,
        "student": {"model": str(model_dirs["student"]), "lora_rank": 0},
        "teacher": {"model": str(model_dirs["teacher"])},
        "datasets": [
            {"name": "rev", "source": str(prompts_file), "groups_per_batch": 2, "group_size": 2}
        ],
        "training": {
            "objective": "sampled_reverse_kl",
            "learning_rate": 1e-3,
            "max_tokens": 6,
            "max_steps": 2,
        },
    }


ANSWERED_WORDS = ("abc", "hgf", "dcea", "bbad", "gah", "fed")


@pytest.fixture
def answered(base_config, tmp_path) -> dict:
    """The base run on prompts that all carry an answer and a metadata entry (for teachers shown
    what the student is not)."""
    path = tmp_path / "answered.jsonl"
    path.write_text(
        "".join(
            json.dumps(
                {
                    "prompt": f"reverse {w}",
                    "answer": w[::-1],
                    "metadata": {"hint": {"first": w[-1]}},
                }
            )
            + "\n"
            for w in ANSWERED_WORDS
        )
    )
    base_config["datasets"][0]["source"] = str(path)
    return base_config
