"""``training.parallel: ddp``: a whole copy of the student per process, gradients averaged by
DistributedDataParallel around the scored forward (lm head included, so its hooks see every
gradient the forward produced)."""

from __future__ import annotations

from contextlib import AbstractContextManager

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from opd.policy.parallel.base import ParallelMode


class DDP(ParallelMode):
    """A replica per process; gradients all-reduced in backward."""

    name = "ddp"
    several_processes = True

    def placement(self, processes: int) -> str:
        return "a replica in every process (DDP)"

    def wrap(self, module: nn.Module, model: nn.Module, device: torch.device) -> nn.Module:
        """``module`` in DistributedDataParallel (buffers such as rotary tables are equal
        everywhere: not broadcast at every forward)."""
        if device.type != "cuda":
            return DistributedDataParallel(module, broadcast_buffers=False)
        index = device.index if device.index is not None else torch.cuda.current_device()
        return DistributedDataParallel(module, device_ids=[index], broadcast_buffers=False)

    def gradient_sync_off(self, module: nn.Module) -> AbstractContextManager:
        return module.no_sync()
