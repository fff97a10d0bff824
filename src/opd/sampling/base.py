"""What any sampler returns, and the interface a faster engine (vLLM, ...) implements."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class Completion:
    """One sampled continuation of a prompt.

    ``logprobs[i]`` is the sampler's log-probability of ``token_ids[i]`` under the
    distribution it actually sampled from (temperature applied). ``finished`` is False
    when ``max_tokens`` cut the completion before a stop token or string.
    """

    token_ids: list[int]
    logprobs: list[float]
    finished: bool


class Sampler(Protocol):
    """Samples completions for token-id prompts; must record the log-prob of every sampled token."""

    def sample(
        self, prompts: list[list[int]], *, temperature: float, max_tokens: int, greedy: bool = False
    ) -> list[Completion]:
        """One completion per prompt (repeat a prompt to get a group). ``greedy`` ignores temperature."""
        ...
