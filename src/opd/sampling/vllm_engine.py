"""The student's rollouts sampled by an in-process ``vllm.LLM``, its weights synced after every
update.

The engine runs in the trainer's process (vLLM's engine core in process, as TRL's colocate
mode does), so a sync hands vLLM the trainer's tensors directly: no disk round trip and no
serialization. ``reload_weights`` loads them layer by layer and re-runs each layer's
post-load processing, which matters on a CPU, where vLLM packs every linear weight into a
oneDNN handle at load time and a plain ``load_weights`` would leave the packed copy stale.
A LoRA student either pushes its merged weights (``W + scale * B @ A``, the default) or saves
its adapter and has vLLM hot-load it in place (``student.lora_sync: adapter``).

Sampling is exactly ``softmax(logits / temperature)`` over the tokenizer's ids: no top-k or
top-p, none of the checkpoint's generation defaults (``generation_config="vllm"``), and the
log-probs vLLM records are the processed ones (temperature applied), so they are the
behaviour policy's. Each row draws from a seed derived from the rollout's seed and its row,
so a resumed run samples the same completions.

Under torchrun every process builds its own engine with vLLM's external launcher
(``distributed_executor_backend: external_launcher``): vLLM joins the processes torchrun started
instead of starting workers of its own. With ``tensor_parallel_size: t`` each t consecutive
processes hold one engine sharded t ways (vLLM's tensor-parallel groups are consecutive ranks):
they gather their rows, generate them all in lock step, and each keeps its own. Rows keep their
seeds, so which tokens a row draws does not depend on the number of processes or on t.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from opd.data.sequences import Completion
from opd.distributed import all_gather_objects, announce, consecutive_groups, rank_in, world
from opd.errors import ConfigError
from opd.models import DTYPES
from opd.sampling.base import SamplingParams, TurnStream, pad_id_for, row_seeds
from opd.sampling.vllm_reload import quiet_expected_reload_warnings, refresh_shared_weight_layers
from opd.sampling.vllm_settings import (
    GPU_MEMORY_UTILIZATION,
    VLLMSettings,
    attention_head_problem,
    engine_options,
    vllm_message,
)

if TYPE_CHECKING:
    from opd.policy.policy import Policy


class VLLMEngine:
    """Samples the student's rollouts with an in-process ``vllm.LLM`` built from ``student.model``.

    :meth:`sync` pushes the policy's weights whenever its version moved since the last push (and
    always before the first rollout, so weights loaded by a resume or ``load_checkpoint_path``
    reach vLLM), then empties the prefix cache, whose entries were computed with the old
    weights. It also serves as a :class:`opd.sampling.base.Sampler` for evaluation, with the
    weights of the last sync.
    """

    def __init__(
        self,
        student: VLLMSettings,
        policy: Policy,
        tokenizer,
        *,
        stop_token_ids: list[int],
        stop_strings: list[str] | None = None,
        seed: int = 0,
    ):
        self.policy = policy
        self.stop_token_ids = list(stop_token_ids)
        self.stop_strings = list(stop_strings or [])
        self.pad_id = pad_id_for(tokenizer, stop_token_ids)
        self.serves_evaluation = True
        self.vocab_size = len(tokenizer)
        self.dtype = DTYPES.get(student.sampling_dtype, policy.dtype)
        self.adapter_sync = policy.has_adapters and student.lora_sync == "adapter"
        self.version: int | None = None
        self.sleeping = False
        self.bucket_bytes = int(student.sync_bucket_mb * 2**20)
        self.tensor_parallel_size = int(student.sampler_options.get("tensor_parallel_size", 1))
        self.group = consecutive_groups(self.tensor_parallel_size) if world().size > 1 else None
        self.llm = self._build(student, seed)
        quiet_expected_reload_warnings()
        self.sleep_mode = bool(student.sampler_options.get("enable_sleep_mode"))
        model_vocab = self.llm.llm_engine.model_config.get_vocab_size()
        self.allowed_token_ids = (
            list(range(self.vocab_size)) if model_vocab > self.vocab_size else None
        )
        self.adapter_dir: Path | None = None
        self.lora_request = None
        if self.adapter_sync:
            self.adapter_dir = Path(tempfile.mkdtemp(prefix="opd-adapter-", dir=_scratch_dir()))
            weakref.finalize(self, shutil.rmtree, self.adapter_dir, True)

    def _build(self, student: VLLMSettings, seed: int):
        for key, problem in student.sampler_problems():
            raise ConfigError(f"student.{key}: {problem}")
        config = self.policy.base_model.config
        head_size = (
            getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        )
        if problem := attention_head_problem(head_size):
            raise ConfigError(f"student.sampler: '{student.model}': {problem}")
        # The engine core must live in this process: a sync hands it the trainer's tensors.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        from vllm import LLM

        options = engine_defaults(self.policy.device) | engine_options(student, world().size)
        announce(f"starting vLLM for the student's rollouts ({student.model}) ...")
        try:
            return LLM(
                model=str(Path(student.model).expanduser()),  # a hub id passes through unchanged
                tokenizer=student.tokenizer,
                dtype=str(self.dtype).removeprefix("torch."),
                seed=seed,
                trust_remote_code=student.trust_remote_code,
                logprobs_mode="processed_logprobs",
                generation_config="vllm",
                **options,
            )
        except Exception as error:  # vLLM raises ValueError, TypeError, pydantic and runtime errors
            raise ConfigError(
                f"student.sampler: vLLM could not build an engine for '{student.model}' with "
                f"sampler_options {student.sampler_options}: {type(error).__name__}: "
                f"{vllm_message(error)}"
            ) from error

    def sync(self, source) -> None:
        """Push ``source``'s weights into the engine if their version is not the engine's.

        ``source``: the policy (gathered a bucket at a time when sharded: a collective every
        process enters together), or weights published for a worker collecting ahead (anything
        with a ``version`` and ``sampler_weights(dtype)``).
        """
        if self.version == source.version and not self.sleeping:
            return
        if self.sleeping:
            self.llm.wake_up(tags=["weights"])
        if self.adapter_sync:
            if source is not self.policy:
                raise ValueError("an adapter sync saves the policy's own adapter")
            self.policy.save_adapter(self.adapter_dir)
            from vllm.lora.request import LoRARequest

            self.lora_request = LoRARequest(
                "opd-student", 1, str(self.adapter_dir), load_inplace=True
            )
        else:
            weights = (
                self.policy.streamed_sampler_weights(self.dtype, self.bucket_bytes)
                if source is self.policy
                else source.sampler_weights(self.dtype)
            )
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
            self.llm.apply_model(refresh_shared_weight_layers)
        if self.sleeping:
            self.llm.wake_up(tags=["kv_cache"])
            self.sleeping = False
        self.llm.reset_prefix_cache()
        self.version = source.version

    def rollout(
        self, prompts: list[list[int]], params: SamplingParams, *, seeds: list[int]
    ) -> list[Completion]:
        """One completion per prompt, each with its behaviour log-probs and the synced version."""
        completions = self.sample(
            prompts,
            temperature=params.temperature,
            max_tokens=params.max_tokens,
            greedy=params.greedy,
            seed=seeds,
        )
        self._sleep()
        return [dataclasses.replace(c, policy_version=self.version) for c in completions]

    def _sleep(self) -> None:
        """After a rollout, free the engine's memory for the update where sleep mode is on: level 2
        frees the weights, which the next sync pushes again; an adapter sync does not push the base
        weights, so they are kept in host memory (level 1)."""
        if self.sleep_mode:
            self.llm.sleep(level=1 if self.adapter_sync else 2)
            self.sleeping = True

    def sample(
        self,
        prompts: list[list[int]],
        *,
        temperature: float,
        max_tokens: int,
        greedy: bool = False,
        seed: int | list[int] | None = None,
    ) -> list[Completion]:
        """One completion per prompt from the engine's current weights (greedy ignores the
        temperature); ``seed`` as :meth:`opd.sampling.base.Sampler.sample` takes it."""
        if self.version is None:
            raise RuntimeError("VLLMEngine.sample before the first sync: call sync(policy) first")
        seeds = [None] * len(prompts) if seed is None else row_seeds(seed, len(prompts))
        share = (0, len(prompts))
        if self.group is not None:
            # the processes of a tensor-parallel group run one engine: each asks for every row
            shares = all_gather_objects((list(prompts), seeds), self.group)
            start = sum(len(rows) for rows, _ in shares[: rank_in(self.group)])
            share = (start, start + len(prompts))
            prompts = [row for rows, _ in shares for row in rows]
            seeds = [row for _, rows in shares for row in rows]
        params = [
            self._params(temperature, max_tokens, greedy, seed_of_row) for seed_of_row in seeds
        ]
        outputs = self.llm.generate(
            [{"prompt_token_ids": list(p)} for p in prompts],
            params,
            use_tqdm=False,
            lora_request=self.lora_request,
        )
        return [self._completion(output.outputs[0]) for output in outputs[share[0] : share[1]]]

    def _params(self, temperature: float, max_tokens: int, greedy: bool, seed: int | None):
        """vLLM's sampling parameters for one row: exactly ``softmax(logits / temperature)``."""
        from vllm import SamplingParams as VLLMSamplingParams

        return VLLMSamplingParams(
            n=1,
            temperature=0.0 if greedy else temperature,
            top_p=1.0,
            top_k=0,
            max_tokens=max_tokens,
            seed=seed,
            logprobs=0,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=True,
            stop=self.stop_strings or None,
            include_stop_str_in_output=True,
            allowed_token_ids=self.allowed_token_ids,
            skip_special_tokens=False,
        )

    @contextmanager
    def turn_stream(self, params: SamplingParams) -> Iterator[TurnStream | None]:
        """Rollout turns submitted one row at a time into the engine's running batch (None where
        the engine is sharded over a tensor-parallel group, whose processes must submit together);
        turns still pending at exit (an environment failed) are aborted."""
        if self.version is None:
            raise RuntimeError(
                "VLLMEngine.turn_stream before the first sync: call sync(policy) first"
            )
        if self.group is not None:
            yield None
            return
        stream = _EngineTurns(self, params)
        try:
            yield stream
        finally:
            if stream.pending:
                self.llm.llm_engine.abort_request(list(stream.pending))
        self._sleep()

    def _completion(self, output) -> Completion:
        token_ids = list(output.token_ids)
        logprobs = [
            float(step[token].logprob)
            for step, token in zip(output.logprobs, token_ids, strict=True)
        ]
        return Completion(token_ids, logprobs, finished=output.finish_reason == "stop")


class _EngineTurns:
    """A :class:`TurnStream` on the in-process engine: requests join vLLM's running batch (its
    continuous batching) and come back as they finish, one engine step at a time. Under torchrun
    each process's engine is its own (vLLM's external launcher with ``data_parallel_size`` 1: vLLM
    does not make the engines step together), so a stream ends when its own turns are done."""

    def __init__(self, engine: VLLMEngine, params: SamplingParams):
        self.engine, self.params = engine, params
        self.pending: dict[str, int] = {}

    def submit(self, key: int, prompt: list[int], seed: int, max_tokens: int) -> None:
        engine, params = self.engine, self.params
        request = engine._params(params.temperature, max_tokens, params.greedy, seed)
        (internal,) = engine.llm.enqueue(
            [{"prompt_token_ids": list(prompt)}],
            [request],
            use_tqdm=False,
            lora_request=engine.lora_request,
        )
        # vLLM answers with the id it was given; the one enqueue returns has a random suffix
        self.pending[internal.rsplit("-", 1)[0]] = key

    def finished(self, waiting: bool = False) -> list[tuple[int, Completion]] | None:
        core = self.engine.llm.llm_engine
        if not core.has_unfinished_requests():
            return [] if waiting else None
        done = []
        for output in core.step():
            if output.finished:
                completion = self.engine._completion(output.outputs[0])
                done.append((self.pending.pop(output.request_id), completion))
        version = self.engine.version
        return [(key, dataclasses.replace(c, policy_version=version)) for key, c in done]


CPU_KV_CACHE_BYTES = 2**30
"""KV cache of an engine on a CPU unless set: vLLM would otherwise take most of the machine's memory
(21 of 23.5 GiB here, 59 s to allocate), leaving none to the trainer it shares the process with."""


def engine_defaults(device) -> dict[str, Any]:
    """The ``vllm.LLM`` arguments opd chooses unless ``student.sampler_options`` sets them."""
    defaults: dict[str, Any] = {"enforce_eager": True}
    if device.type == "cpu" and "VLLM_CPU_KVCACHE_SPACE" not in os.environ:
        defaults["kv_cache_memory_bytes"] = CPU_KV_CACHE_BYTES
    if device.type == "cuda":
        defaults["gpu_memory_utilization"] = GPU_MEMORY_UTILIZATION
    return defaults


def _scratch_dir() -> str | None:
    """Memory-backed scratch space for adapter syncs where there is one."""
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
