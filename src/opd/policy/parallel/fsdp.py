"""``training.parallel: fsdp``: weights, gradients and optimizer state sharded across the processes
with FSDP2 (``fully_shard`` per transformer block, then the rest: embeddings, final norm, lm
head), each shard gathered while it is used and freed again. The optimizer must be built after
:meth:`FSDP.wrap`: it replaces the parameters with sharded ones."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

from opd.policy.parallel.base import ParallelMode, WeightsFn


class FSDP(ParallelMode):
    """Every process holds a shard of the student."""

    name = "fsdp"
    several_processes = True
    shards = True

    def placement(self, processes: int) -> str:
        return f"FSDP2-sharded over {processes} processes"

    def wrap(self, module: nn.Module, model: nn.Module, device: torch.device) -> nn.Module:
        return apply_fsdp(module, model)

    def gradient_sync_off(self, module: nn.Module) -> AbstractContextManager:
        return _sync_off(module)

    @contextmanager
    def gathered(self, module: nn.Module) -> Iterator[None]:
        modules = fsdp_modules(module)
        with torch.no_grad():
            for unit in modules:
                unit.unshard()
        try:
            yield
        finally:
            for unit in modules:
                unit.reshard()

    def reshard(self, module: nn.Module) -> None:
        """FSDP keeps the root's weights whole after a forward, expecting the backward; after a
        forward with no backward the next forward and backward would otherwise start from that
        state."""
        for unit in fsdp_modules(module):
            unit.reshard()

    def streamed_weights(
        self,
        module: nn.Module,
        weights: WeightsFn,
        names: dict[int, str],
        bucket_bytes: int,
        itemsize: int,
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """The sharded units (each transformer block, then the rest) in buckets of consecutive units
        holding up to ``bucket_bytes`` of full weights (at least one unit): a bucket is gathered on
        every process (a collective each enters together, in the same order), copied out and freed
        before any of its weights is handed out (a loader may keep a tensor past the next gather),
        so at most one bucket, and its copy while it is made, is ever whole."""
        for bucket in buckets(fsdp_units(module, names), bucket_bytes, itemsize):
            with torch.no_grad():
                for unit, _, _ in bucket:
                    unit.unshard()
            try:
                only = set().union(*(unit_names for _, unit_names, _ in bucket))
                gathered = [(name, tensor.clone()) for name, tensor in weights(only)]
            finally:
                for unit, _, _ in bucket:
                    unit.reshard()
            yield from gathered

    def whole_trainable_state(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The trained parameters' shards gathered (a collective: every process calls it
        together)."""
        with torch.no_grad():
            return {
                name: parameter.full_tensor() if isinstance(parameter, DTensor) else parameter
                for name, parameter in model.named_parameters()
                if parameter.requires_grad
            }


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The model's repeated blocks: the classes its ``_no_split_modules`` names (HF's own list)."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    blocks = [module for module in model.modules() if type(module).__name__ in names]
    if not blocks:
        raise TypeError(
            f"{type(model).__name__} names no transformer block class in _no_split_modules, so "
            "FSDP cannot shard it block by block; use training.parallel: ddp"
        )
    return blocks


def apply_fsdp(module: nn.Module, model: nn.Module) -> nn.Module:
    """Shard each of ``model``'s transformer blocks, then ``module`` (the rest) with
    ``fully_shard``."""
    for block in transformer_blocks(model):
        fully_shard(block)
    return fully_shard(module)


def fsdp_modules(module: nn.Module) -> list[FSDPModule]:
    """Every module that ``fully_shard`` wrapped, inner ones first."""
    return [m for m in module.modules() if isinstance(m, FSDPModule)][::-1]


def fsdp_units(module: nn.Module, names: dict[int, str]) -> list[tuple[nn.Module, set[str], int]]:
    """Each module ``fully_shard`` wrapped, outer first, with the names (from ``names``: parameter
    id to name) of the parameters it manages itself (not those of the units inside it) and their
    full element count."""
    units = []
    for unit in fsdp_modules(module)[::-1]:
        nested = [m for m in unit.modules() if m is not unit and isinstance(m, FSDPModule)]
        inner = {id(p) for m in nested for p in m.parameters()}
        own = [p for p in unit.parameters() if id(p) not in inner and id(p) in names]
        units.append((unit, {names[id(p)] for p in own}, sum(p.numel() for p in own)))
    return units


def buckets(units: list, bucket_bytes: int, itemsize: int) -> list[list]:
    """Consecutive ``units`` grouped so each group's full weights fit in ``bucket_bytes`` (a unit
    larger than that is a group of its own)."""
    groups: list[list] = []
    size = 0
    for unit in units:
        unit_bytes = unit[2] * itemsize
        if groups and size + unit_bytes <= bucket_bytes:
            groups[-1].append(unit)
            size += unit_bytes
        else:
            groups.append([unit])
            size = unit_bytes
    return groups


@contextmanager
def _sync_off(module: nn.Module) -> Iterator[None]:
    """FSDP keeps this backward's gradients unreduced (accumulating micro-batches), then reduces
    again."""
    module.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        module.set_requires_gradient_sync(True)
