"""How a substep's rows are cut into forwards: the token budget of a micro-batch (the
``training.micro_batch_tokens`` set, or one sized for the device from the student's shape),
rows counted instead, and whether each forward runs packed."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from opd.config import TrainingConfig
from opd.data.batching import split_to, token_bins
from opd.data.sequences import RolloutBatch
from opd.distributed import all_reduce
from opd.errors import ConfigError

ACTIVATION_SHARE = 0.25
"""The share of the device's memory an unset budget gives the update's activations."""
BUDGET_STEP = 1024
"""An unset budget is a multiple of this many tokens."""


def activation_bytes_per_token(
    model_config, element_bytes: int, lora: bool, checkpointed: bool = False
) -> int:
    """What the update keeps per token for its backward, per layer: sixteen hidden-size vectors
    (norms in and out, attention's projections, output and residuals), six intermediate-size ones
    (the MLP's products and activation), the keys and values twice, and with LoRA each adapted
    input once more; with gradient checkpointing, each layer's input and one layer's all of
    that (recomputed in backward). The lm head is not counted: it works ``logprob_chunk_size``
    positions at a time. Checked against a measured peak in
    docs/benchmarks.md#packed-micro-batches."""
    text = (
        model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    )
    hidden = text.hidden_size
    intermediate = getattr(text, "intermediate_size", None) or 4 * hidden
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or hidden // heads
    key_values = (getattr(text, "num_key_value_heads", None) or heads) * head_dim
    per_layer = 16 * hidden + 6 * intermediate + 4 * key_values + (7 * hidden if lora else 0)
    if checkpointed:
        return (text.num_hidden_layers * hidden + per_layer) * element_bytes
    return text.num_hidden_layers * per_layer * element_bytes


def device_memory(device: torch.device) -> int:
    """The device's whole memory in bytes (a GPU's, or the machine's RAM for a CPU)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def sized_budget(memory: int, bytes_per_token: int) -> int:
    """``ACTIVATION_SHARE`` of ``memory`` in tokens, rounded down to ``BUDGET_STEP`` (at least one
    step)."""
    tokens = int(ACTIVATION_SHARE * memory / max(bytes_per_token, 1))
    return max(BUDGET_STEP, tokens // BUDGET_STEP * BUDGET_STEP)


def resolve_token_budget(
    training: TrainingConfig,
    longest_prompt: int,
    size_for_device: Callable[[], int],
    longest_completion: tuple[int, str] | None = None,
) -> int:
    """The run's tokens per micro-batch: the configured budget (refused when the longest possible
    row, ``longest_prompt`` plus the longest completion, does not fit in it), else
    ``size_for_device()`` (the same on every process: the smallest) raised to the longest
    possible row. ``longest_completion``: its tokens and the setting that bounds it (default
    ``training.max_tokens``; an environment's episode budget is longer)."""
    completion, bound = longest_completion or (training.max_tokens, "training.max_tokens")
    longest_row = longest_prompt + completion
    if training.micro_batch_tokens is not None:
        if training.micro_batch_tokens < longest_row:
            raise ConfigError(
                f"training.micro_batch_tokens: {training.micro_batch_tokens} tokens cannot hold "
                f"the longest possible row, {longest_row} tokens (the longest prompt, "
                f"{longest_prompt} tokens, plus {bound} {completion}); raise it to at least "
                f"{longest_row} or shorten the prompts"
            )
        return training.micro_batch_tokens
    (smallest,) = all_reduce([-float(size_for_device())], op="max")
    return max(int(-smallest), longest_row)


@dataclass(frozen=True)
class MicroBatching:
    """The run's micro-batches: at most ``tokens`` tokens (None: not counted) and ``rows`` rows
    (None: not counted), each forward ``packed`` or padded."""

    tokens: int | None = None
    rows: int | None = None
    packed: bool = False

    def split(self, part: RolloutBatch) -> list[list[int]]:
        """The row indices of each forward / backward over a substep's ``part``
        (:func:`opd.data.batching.token_bins`), as many on every process (a sharded or replicated
        student's forwards are collectives): a process with fewer splits its largest."""
        lengths = [int(n) for n in part.attention_mask_BT.sum(-1).tolist()]
        bins = token_bins(lengths, self.tokens, self.rows, padded=not self.packed)
        (most,) = all_reduce([float(len(bins))], op="max")
        return split_to(bins, int(most))
