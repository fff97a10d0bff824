"""What a parallel mode is: how several processes (``torchrun``) share the student. Each mode is a
subclass in a module of :mod:`opd.policy.parallel`, registered by its ``name``; it owns how it
wraps the student's scored forward, holds gradients back while micro-batches accumulate, makes
the weights whole for a sampler or a saved adapter, and what the dry-run plan says of it.
Checkpoints of several processes are written by ``torch.distributed.checkpoint`` whatever the
mode (:mod:`opd.runs.sharded_state` reads DDP's whole tensors and FSDP's shards alike)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import ClassVar

import torch
from torch import nn

REGISTRY: dict[str, type[ParallelMode]] = {}
"""Every mode, by name, as each module of :mod:`opd.policy.parallel` declares it."""

WeightsFn = Callable[[set[str] | None], Iterator[tuple[str, torch.Tensor]]]
"""The sampler's weights (of the named parameters only, or all with None), as the policy gives
them."""


class ParallelMode:
    """A mode with nothing to do: one process holds the whole student (``none``)."""

    name: ClassVar[str]
    """How ``training.parallel`` names it."""
    several_processes: ClassVar[bool] = False
    """Whether it needs several processes (else exactly one)."""
    shards: ClassVar[bool] = False
    """Whether each process holds only a shard of the weights."""

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if "name" in cls.__dict__:
            REGISTRY[cls.name] = cls

    def placement(self, processes: int) -> str:
        """Where the student lives, as the dry-run plan prints it."""
        return "one process"

    def wrap(self, module: nn.Module, model: nn.Module, device: torch.device) -> nn.Module:
        """``module`` (the student's scored forward, around ``model``) as this mode runs it."""
        return module

    def gradient_sync_off(self, module: nn.Module) -> AbstractContextManager:
        """A context in which backward keeps its gradients unreduced (accumulating
        micro-batches)."""
        return nullcontext()

    @contextmanager
    def gathered(self, module: nn.Module) -> Iterator[None]:
        """Every weight whole on every process while inside (a collective where the mode shards)."""
        yield

    def reshard(self, module: nn.Module) -> None:
        """Free every gathered weight (after a forward with no backward)."""

    def streamed_weights(
        self,
        module: nn.Module,
        weights: WeightsFn,
        names: dict[int, str],
        bucket_bytes: int,
        itemsize: int,
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """The sampler's weights, no more than ``bucket_bytes`` of them gathered at a time."""
        yield from weights(None)

    def whole_trainable_state(self, model: nn.Module) -> dict[str, torch.Tensor] | None:
        """The trained parameters as whole tensors for saving, or None where they are whole
        already."""
        return None
