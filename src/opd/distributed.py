"""The process group a run trains in: who this process is, and the few collectives the trainer uses.

One process (``opd train``) has no group: rank 0 of a world of 1, and every reduction is the
identity. Under ``torchrun`` the environment names the rank and world size; :func:`init_from_env`
joins the group once, on the backend the run asks for (``gloo`` for CPUs, ``nccl`` for GPUs).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from opd.errors import ConfigError

LAUNCH_HINT = (
    "launch with `torchrun --nproc_per_node N -m opd train CONFIG` or `opd train CONFIG --nproc N`"
)


@dataclass(frozen=True)
class World:
    """This process's place among the run's processes."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        """Rank 0 logs, shows progress and writes the run's files."""
        return self.rank == 0


def launched_world() -> World:
    """The world ``torchrun`` describes in the environment (one process when it describes none)."""
    return World(
        int(os.environ.get("RANK", 0)),
        int(os.environ.get("WORLD_SIZE", 1)),
        int(os.environ.get("LOCAL_RANK", 0)),
    )


def announce(text: str) -> None:
    """``opd: text`` on stderr from the first process: a phase that can take minutes (loading a
    model, starting an engine) says what it is doing, now that third-party logs are quiet."""
    if launched_world().is_main:
        print(f"opd: {text}", file=sys.stderr, flush=True)


def world() -> World:
    """This process's world: the joined group's, else a world of one."""
    if not dist.is_available() or not dist.is_initialized():
        return World()
    return World(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", 0)))


def resolve_backend(backend: str, device: torch.device) -> str:
    """``auto``: NCCL for CUDA devices, gloo otherwise; NCCL on a CPU is refused."""
    if backend == "auto":
        return "nccl" if device.type == "cuda" else "gloo"
    if backend == "nccl" and (device.type != "cuda" or not torch.cuda.is_available()):
        raise ConfigError(
            "training.dist_backend: nccl needs CUDA GPUs, and this run's student is on "
            f"{device.type}{'' if torch.cuda.is_available() else ' (no CUDA device here)'}; use "
            "gloo (or auto) on CPUs"
        )
    return backend


def process_device(device: str, local: World) -> str:
    """The student's device for this process: each process of a node takes its own GPU."""
    if local.size == 1:
        return device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        return f"cuda:{local.local_rank}"
    return device


def init_from_env(backend: str, device: torch.device, timeout_s: float) -> World:
    """Join the process group ``torchrun`` set up (nothing to join for one process)."""
    local = launched_world()
    if local.size == 1 or dist.is_initialized():
        return world()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        resolve_backend(backend, device),
        timeout=timedelta(seconds=timeout_s),
        device_id=device if device.type == "cuda" else None,
    )
    return world()


def shutdown() -> None:
    """Leave the process group (a no-op without one)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def _group_device() -> torch.device:
    return (
        torch.device("cuda", torch.cuda.current_device())
        if dist.get_backend() == "nccl"
        else torch.device("cpu")
    )


def all_reduce(values: list[float], op: str = "sum") -> list[float]:
    """Element-wise sum (or max) of ``values`` over every process, in float64."""
    if world().size == 1:
        return list(values)
    tensor = torch.tensor(values, dtype=torch.float64, device=_group_device())
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
    return tensor.tolist()


def all_gather_objects(value: object, group: dist.ProcessGroup | None = None) -> list[object]:
    """Every process's ``value`` (of ``group``, default all), in rank order (picklable Python
    objects; for small records)."""
    size = world().size if group is None else dist.get_world_size(group)
    if size == 1:
        return [value]
    gathered: list[object] = [None] * size
    dist.all_gather_object(gathered, value, group=group)
    return gathered


def rank_in(group: dist.ProcessGroup) -> int:
    """This process's rank within ``group``."""
    return dist.get_rank(group)


def consecutive_groups(size: int) -> dist.ProcessGroup | None:
    """This process's group among the world split into groups of ``size`` consecutive ranks
    (ranks 0..size-1, size..2*size-1, ...); None when each process is a group of its own.

    A collective: every process must call it together (each group is created on all of them).
    """
    if size == 1:
        return None
    processes = world()
    groups = [list(range(start, start + size)) for start in range(0, processes.size, size)]
    mine, _ = dist.new_subgroups_by_enumeration(groups)
    return mine


def broadcast_object(value: object, group: dist.ProcessGroup | None = None) -> object:
    """Rank 0's ``value`` on every process (of ``group``, which must hold rank 0; default all)."""
    if world().size == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def new_group() -> dist.ProcessGroup | None:
    """A group of every process, apart from the default one: collectives a worker thread issues on
    it never interleave with the main thread's (a collective: every process calls it together)."""
    if world().size == 1:
        return None
    return dist.new_group(backend="gloo")


def barrier() -> None:
    """Wait until every process gets here."""
    if world().size > 1:
        dist.barrier()
