"""Loading Hugging Face causal LMs and tokenizers, with errors that say what to do."""

from __future__ import annotations

import functools
import os
import socket
import urllib.parse
import warnings
from pathlib import Path

import torch
from huggingface_hub import try_to_load_from_cache
from transformers import AutoModelForCausalLM, AutoTokenizer

from opd.errors import ModelLoadError
from opd.locations import missing_path_problem

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def module_device(module: torch.nn.Module) -> torch.device:
    """Where a module's weights live (its first parameter's device; CPU for a module without
    any)."""
    first = next(module.parameters(), None)
    return first.device if first is not None else torch.device("cpu")


def resolve_device(device: str) -> torch.device:
    """``auto`` picks CUDA when present, else CPU."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """``auto``: bfloat16 on a GPU that supports it, float32 elsewhere (CPU half precision is
    slow)."""
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
            f"instructions, so {name} matmuls run far slower than float32 here; use float32 on "
            "this machine",
            stacklevel=3,
        )


HUB_PROBE_TIMEOUT_S = 3.0
"""How long to wait for the hub's address before calling it unreachable (transformers retries ~50
s)."""


@functools.cache
def hub_unreachable() -> str | None:
    """None if the Hugging Face hub (``HF_ENDPOINT``) takes a connection; else its address."""
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    parts = urllib.parse.urlsplit(endpoint)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        socket.create_connection((parts.hostname or "", port), timeout=HUB_PROBE_TIMEOUT_S).close()
    except OSError:
        return endpoint
    return None


def _offline() -> bool:
    return any(os.environ.get(key, "").lower() in ("1", "true", "yes") for key in OFFLINE_SETTINGS)


OFFLINE_SETTINGS = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")


def model_source(name: str, field: str) -> tuple[str, bool]:
    """Where to load ``name`` from, and whether from the local cache only: a path as it is; a hub id
    from the hub, or from the cache when the hub cannot be reached (said in seconds, not after
    transformers' minute of retries, when it is not cached either)."""
    if problem := missing_path_problem(name):
        raise ModelLoadError(f"{field}: {problem}")
    path = Path(name).expanduser()
    if path.exists():
        return str(path), False
    if _offline() or (endpoint := hub_unreachable()) is None:
        return name, False
    if isinstance(try_to_load_from_cache(name, "config.json"), str):
        return name, True
    raise ModelLoadError(
        f"{field}: '{name}' is not a local path, this machine cannot reach the Hugging Face hub "
        f"({endpoint}), and it is not in the Hugging Face cache. Give a local directory (download "
        f"it where there is network: huggingface-cli download {name} --local-dir DIR), or with it "
        "cached set HF_HUB_OFFLINE=1"
    )


def load_tokenizer(name: str, field: str, *, trust_remote_code: bool = False):
    """A tokenizer by hub id or path; a pad token is added from EOS when missing."""
    source, cached_only = model_source(name, field)
    try:
        tokenizer = AutoTokenizer.from_pretrained(
            source, trust_remote_code=trust_remote_code, local_files_only=cached_only
        )
    except (OSError, ValueError) as error:
        raise ModelLoadError(f"{field}: cannot load a tokenizer from '{name}': {error}") from error
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_causal_lm(
    name: str, field: str, *, dtype: str, device: str, trust_remote_code: bool = False
):
    """A causal LM on its device, in eval mode. ``field`` names the config key in errors."""
    source, cached_only = model_source(name, field)
    target = resolve_device(device)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            source,
            dtype=resolve_dtype(dtype, target),
            trust_remote_code=trust_remote_code,
            local_files_only=cached_only,
            # transformers looks for a PEFT adapter config online even with local_files_only: a
            # minute of retries to an unreachable hub (seen with transformers 5.25) without this
            **({"adapter_kwargs": {"local_files_only": True}} if cached_only else {}),
        )
    except (OSError, ValueError) as error:
        raise ModelLoadError(
            f"{field}: cannot load a causal LM from '{name}': {error}. Give a local directory with "
            "config.json and weights, or a hub id reachable from this machine."
        ) from error
    dtype_field = field.removesuffix("model") + "dtype"
    warn_if_slow_on_this_cpu(model.dtype, target, dtype_field)
    return model.to(target).eval()


PROBE_TEXTS = (
    "The quick brown fox jumps over the lazy dog.",
    "QUICK Brown 12 + 7 = 19; x**2 - 3*x >= 0",
    "  two leading spaces\n\ttab, CR LF\r\nend ",
    "caf\u00e9 na\u00efve \u00dc \u6771\u4eac \U0001f642",
)
"""Texts both tokenizers must split alike: cases, digits, whitespace, accents and other scripts
(an equal vocabulary with another normalizer or pre-tokenizer gives other ids)."""


def check_same_vocabulary(student_tokenizer, teacher_tokenizer, teacher_field: str) -> None:
    """The sampled-token KL compares ids: both models must read ids the same way, the same
    entries and the same ids for every probe text (:data:`PROBE_TEXTS`)."""
    student_vocab = student_tokenizer.get_vocab()
    teacher_vocab = teacher_tokenizer.get_vocab()
    fix = (
        "Scoring needs the same token ids; a teacher with a different tokenizer needs "
        "cross-tokenizer mode: set cross_tokenizer: true beside it."
    )
    if student_vocab != teacher_vocab:
        only_student = len(set(student_vocab.items()) - set(teacher_vocab.items()))
        raise ModelLoadError(
            f"{teacher_field}: the teacher's tokenizer differs from the student's "
            f"({len(teacher_vocab)} vs {len(student_vocab)} entries, {only_student} student "
            f"entries not in the teacher's). {fix}"
        )
    for text in PROBE_TEXTS:
        ids = student_tokenizer.encode(text, add_special_tokens=False)
        teacher_ids = teacher_tokenizer.encode(text, add_special_tokens=False)
        if ids != teacher_ids:
            raise ModelLoadError(
                f"{teacher_field}: the teacher's tokenizer has the student's entries but splits "
                f"{text!r} otherwise (ids {teacher_ids[:12]} against the student's {ids[:12]}): "
                f"another normalizer or pre-tokenizer. {fix}"
            )
