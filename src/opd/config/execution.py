"""How a step runs, the ``training`` fields that change no number it learns: micro-batches,
collection ahead of learning, the processes sharing the student, what is shown and watched.
Sections of :class:`opd.config.training.TrainingConfig` (the YAML stays one flat ``training``)."""

from __future__ import annotations

import difflib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

from opd.checks import range_problems
from opd.policy.parallel import parallel_modes


@dataclass
class MicroBatchSettings:
    """How a batch is cut into forwards: micro-batches, packing, log-prob chunks."""

    micro_batch_size: int | None = None
    """Most sequences per forward/backward inside a substep (gradient accumulation). Without
    ``micro_batch_tokens``: runs of this many rows in batch order (None: one micro-batch)."""
    micro_batch_tokens: int | None = None
    """Most tokens (prompt + completion, padding not counted when ``packing``) per forward /
    backward: each substep's rows are binned by length, longest first, into as few micro-batches
    as fit (the same bins for the same rows, on resume and on any number of processes; a process
    with fewer bins than another splits its largest). Unset: sized for the device when the run
    starts, about a quarter of its memory for activations (estimated from the model's shape;
    ``opd train --dry-run`` prints it), unless ``micro_batch_size`` is set. The number of
    micro-batches changes no number the update computes beyond rounding (the loss is normalised
    by the whole batch's token and sequence counts). Must hold the longest possible row: the
    longest prompt plus ``max_tokens``."""
    packing: bool = True
    """Run each micro-batch's sequences as one padding-free row (position ids restarting per
    sequence, attention within each; flash-attention varlen on GPUs, sdpa per sequence
    otherwise), in the update, the current log-probs and a local teacher's forward. A model
    whose attention cannot pack (not sdpa or flash attention, sliding windows without flash
    attention) runs padded, said once. False pads every micro-batch to its longest row."""
    logprob_chunk_size: int = 1024
    """Positions whose logits exist at once when computing log-probs (memory vs speed)."""
    teacher_batch_size: int = 32
    """Most sequences per forward of a local teacher (also at most ``micro_batch_tokens``
    tokens)."""

    def problems(self) -> Iterator[tuple[str, str]]:
        """``(field, problem)`` for this section's own fields."""
        yield from range_problems(
            self,
            positive=(
                "micro_batch_size",
                "micro_batch_tokens",
                "logprob_chunk_size",
                "teacher_batch_size",
            ),
        )


@dataclass
class CollectionSettings:
    """Collecting batches ahead of learning."""

    max_staleness: int = 0
    """Collect up to this many steps ahead of learning: with k >= 1, the batches of steps
    i+1..i+k are sampled and scored by a background worker (with its own copy of the weights,
    refreshed after every update) while step i learns, so a batch may come from weights up to k
    updates old (its recorded log-probs make the importance ratio correct). 0: the synchronous
    loop."""

    def problems(self) -> Iterator[tuple[str, str]]:
        """``(field, problem)`` for this section's own fields."""
        yield from range_problems(self, non_negative=("max_staleness",))


@dataclass
class ParallelSettings:
    """Several processes (torchrun) sharing the student."""

    parallel: str = "auto"
    """How several processes (``torchrun --nproc_per_node N``) share the student, by a mode of
    ``opd.policy.parallel``: ``none`` is one process with the whole student; ``ddp`` keeps a
    whole copy per process and averages gradients; ``fsdp`` shards weights, gradients and optimizer
    state across them (PyTorch FSDP2, ``fully_shard`` per transformer block); ``auto`` is none for
    one process and fsdp for several. Each process samples, scores and learns from its share of
    every step's groups; the update equals one process's on the whole batch."""
    dist_backend: Literal["auto", "gloo", "nccl"] = "auto"
    """The torch.distributed backend under torchrun: ``auto`` is nccl on GPUs, gloo on CPUs."""
    dist_timeout_s: float = 1800.0
    """How long a process waits in a collective for the others before the job fails."""

    def problems(self) -> Iterator[tuple[str, str]]:
        """``(field, problem)`` for this section's own fields."""
        choices = ["auto", *parallel_modes()]
        if self.parallel not in choices:
            hint = difflib.get_close_matches(self.parallel, choices, n=1)
            suggestion = f" (did you mean {hint[0]!r}?)" if hint else ""
            yield "parallel", f"{self.parallel!r} is not one of {choices}{suggestion}"
        yield from range_problems(self, positive=("dist_timeout_s",))


@dataclass
class MonitoringSettings:
    """What the run shows and how it reacts to signs of going wrong."""

    show_examples: bool = False
    """Print one coloured sample per dataset per step (prompt, trained tokens, per-token KL)."""
    stop_on_divergence: bool = False
    """Stop the run at the first sign of it going wrong (entropy collapse, teacher KL rising for 5
    steps, ``kl_sample_train`` or the gradient norm exploding, held-out accuracy falling), keeping
    the last checkpoint; otherwise each sign is only warned about, once."""
