"""Loading Hugging Face causal LMs and tokenizers, with errors that say what to do."""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from opd.errors import ModelLoadError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def module_device(module: torch.nn.Module) -> torch.device:
    """Where a module's weights live (its first parameter's device; CPU for a module without any)."""
    first = next(module.parameters(), None)
    return first.device if first is not None else torch.device("cpu")


def resolve_device(device: str) -> torch.device:
    """``auto`` picks CUDA when present, else CPU."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """``auto``: bfloat16 on a GPU that supports it, float32 elsewhere (CPU half precision is slow)."""
    if dtype != "auto":
        return DTYPES[dtype]
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return torch.float32


def warn_if_slow_on_this_cpu(dtype: torch.dtype | None, device: torch.device, field: str) -> None:
    """Warn when half precision on this CPU would take PyTorch's scalar fallback for matmuls.

    Without the instructions oneDNN needs (AVX-512 for bfloat16, AVX-512-FP16 or AMX for
    float16) such matmuls run orders of magnitude slower than float32: a run there would crawl
    without saying why.
    """
    if device.type != "cpu" or dtype not in (torch.bfloat16, torch.float16):
        return
    supported = (
        torch.ops.mkldnn._is_mkldnn_bf16_supported
        if dtype == torch.bfloat16
        else torch.ops.mkldnn._is_mkldnn_fp16_supported
    )
    if not supported():
        name = str(dtype).removeprefix("torch.")
        warnings.warn(
            f"{field}: this CPU ({torch.backends.cpu.get_cpu_capability()}) has no {name} matmul "
            f"instructions, so {name} matmuls run far slower than float32 here; use float32 "
            "on this machine",
            stacklevel=3,
        )


def _looks_local(name: str) -> bool:
    return name.startswith((".", "/", "~")) or Path(name).expanduser().exists() or name.count("/") > 1


def _check_exists(name: str, field: str) -> str:
    path = Path(name).expanduser()
    if _looks_local(name) and not path.exists():
        raise ModelLoadError(f"{field}: path '{name}' does not exist")
    return str(path) if path.exists() else name


def load_tokenizer(name: str, field: str, *, trust_remote_code: bool = False):
    """A tokenizer by hub id or path; a pad token is added from EOS when missing."""
    source = _check_exists(name, field)
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as error:
        raise ModelLoadError(f"{field}: cannot load a tokenizer from '{name}': {error}") from error
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_causal_lm(name: str, field: str, *, dtype: str, device: str, trust_remote_code: bool = False):
    """A causal LM on its device, in eval mode. ``field`` names the config key in errors."""
    source = _check_exists(name, field)
    target = resolve_device(device)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            source, dtype=resolve_dtype(dtype, target), trust_remote_code=trust_remote_code
        )
    except (OSError, ValueError) as error:
        raise ModelLoadError(
            f"{field}: cannot load a causal LM from '{name}': {error}. Give a local directory with "
            "config.json and weights, or a hub id reachable from this machine."
        ) from error
    dtype_field = field.removesuffix("model") + "dtype"
    warn_if_slow_on_this_cpu(model.dtype, target, dtype_field)
    return model.to(target).eval()


def check_same_vocabulary(student_tokenizer, teacher_tokenizer, teacher_field: str) -> None:
    """The sampled-token KL compares ids: both models must read ids the same way."""
    student_vocab = student_tokenizer.get_vocab()
    teacher_vocab = teacher_tokenizer.get_vocab()
    if student_vocab != teacher_vocab:
        only_student = len(set(student_vocab.items()) - set(teacher_vocab.items()))
        raise ModelLoadError(
            f"{teacher_field}: the teacher's tokenizer differs from the student's "
            f"({len(teacher_vocab)} vs {len(student_vocab)} entries, {only_student} student entries not "
            "in the teacher's). Scoring needs the same token ids; a teacher with a different "
            "tokenizer needs cross-tokenizer mode: set cross_tokenizer: true beside it."
        )
