"""The student's settings, as the config's ``student`` section holds them."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

from opd.checks import range_problems
from opd.locations import device_problem, missing_path_problem


@dataclass
class StudentConfig:
    """The model being trained (the engine that samples its rollouts declares its own settings
    beside it, in :mod:`opd.sampling`, and the ``student`` section holds both)."""

    model: str
    """Hugging Face model id or local directory."""
    lora_rank: int = 32
    """LoRA rank; 0 trains every weight (full fine-tuning)."""
    lora_alpha: float | None = None
    """LoRA scaling numerator; defaults to ``lora_rank`` (scale 1)."""
    lora_dropout: float = 0.0
    """Dropout on the LoRA branch."""
    lora_target_modules: list[str] | str = "all-linear"
    """Modules that get adapters: PEFT's ``all-linear`` (every linear layer but the lm head) or
    names."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Weights dtype; ``auto`` is bfloat16 on a GPU that supports it, float32 otherwise."""
    device: str = "auto"
    """``auto`` (CUDA if available, else CPU), or a torch device string such as ``cuda:1``."""
    chat_template: str | None = None
    """A Jinja chat template replacing the tokenizer's own (required for base models without
    one)."""
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    """Variables the chat template reads, e.g. ``{enable_thinking: false}`` to turn off Qwen3's
    thinking mode (its template thinks unless told not to)."""
    tokenizer: str | None = None
    """Tokenizer id or path when it is not stored with the model."""
    trust_remote_code: bool = False
    """Run model code shipped in the checkpoint; off unless you trust its source."""
    gradient_checkpointing: bool = False
    """Recompute activations in backward: less memory, about a third more compute."""

    def problems(self) -> Iterator[tuple[str, str]]:
        """``(field, problem)`` for the model's settings, found before any model loads."""
        for key, check in (
            ("model", missing_path_problem),
            ("tokenizer", missing_path_problem),
            ("device", device_problem),
        ):
            value = getattr(self, key)
            if value and (problem := check(value)):
                yield key, problem
        yield from range_problems(self, positive=("lora_alpha",), non_negative=("lora_rank",))
        if not 0.0 <= self.lora_dropout < 1.0:
            yield "lora_dropout", f"must be in [0, 1), got {self.lora_dropout}"
