"""Data parallelism (DDP) and sharding (FSDP2) applied to the student's scored forward.

Both wrap :class:`opd.logprobs.ScoredRows`, the module whose one call runs the body and the
lm head, so their hooks see the whole forward: DDP reduces every gradient it produced, FSDP
gathers every shard it reads (the lm head's too) and frees it again.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.nn.parallel import DistributedDataParallel


def apply_ddp(module: nn.Module, device: torch.device) -> nn.Module:
    """``module`` in DistributedDataParallel (buffers such as rotary tables are equal everywhere:
    not broadcast at every forward)."""
    if device.type != "cuda":
        return DistributedDataParallel(module, broadcast_buffers=False)
    index = device.index if device.index is not None else torch.cuda.current_device()
    return DistributedDataParallel(module, device_ids=[index], broadcast_buffers=False)


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The model's repeated blocks: the classes its ``_no_split_modules`` names (HF's own list)."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    blocks = [module for module in model.modules() if type(module).__name__ in names]
    if not blocks:
        raise TypeError(
            f"{type(model).__name__} names no transformer block class in _no_split_modules, "
            "so FSDP cannot shard it block by block; use training.parallel: ddp"
        )
    return blocks


def apply_fsdp(module: nn.Module, model: nn.Module) -> nn.Module:
    """Shard each of ``model``'s transformer blocks, then ``module`` (the rest) with ``fully_shard``."""
    for block in transformer_blocks(model):
        fully_shard(block)
    return fully_shard(module)


def fsdp_modules(module: nn.Module) -> list[FSDPModule]:
    """Every module that ``fully_shard`` wrapped, inner ones first."""
    return [m for m in module.modules() if isinstance(m, FSDPModule)][::-1]
