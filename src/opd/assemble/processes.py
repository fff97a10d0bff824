"""What a run of several processes needs to hold, checked before any model loads, each
process's own view of the config, and ``opd train --nproc N``'s torchrun launch."""

from __future__ import annotations

import dataclasses
import signal
import subprocess
import sys

from opd.config import Config, ConfigError
from opd.data.batching import rank_split_problem
from opd.distributed import LAUNCH_HINT, World, process_device, resolve_backend
from opd.models import resolve_device
from opd.policy.parallel import AUTO_SEVERAL, parallel_modes
from opd.sampling.vllm_settings import engine_layout_problem, tensor_parallel_problem


def resolve_parallel(requested: str, processes: int) -> str:
    """``training.parallel`` resolved for this many processes; refused where it cannot apply."""
    modes = parallel_modes()
    if requested == "auto":
        return (
            AUTO_SEVERAL
            if processes > 1
            else next(n for n, m in modes.items() if not m.several_processes)
        )
    several = modes[requested].several_processes
    if several and processes == 1:
        single = [name for name, mode in modes.items() if not mode.several_processes]
        raise ConfigError(
            f"training.parallel: {requested} needs several processes and this is one; "
            f"{LAUNCH_HINT}, or set parallel: {' or '.join(single)} (or auto)"
        )
    if not several and processes > 1:
        shared = [name for name, mode in modes.items() if mode.several_processes]
        raise ConfigError(
            f"training.parallel: {requested} with {processes} processes would train {processes} "
            f"unrelated copies; use {', '.join(shared)} or auto"
        )
    return requested


def step_group_sizes(config: Config) -> list[int]:
    """The sequences of each prompt's group in a step, in the order a step lists them."""
    sizes = []
    for dataset in config.datasets:
        size = 1 if config.training.data_source == "dataset" else dataset.group_size
        sizes += [size] * dataset.groups_per_batch
    return sizes


def for_this_process(config: Config, processes: World) -> Config:
    """The config with each model on this process's device (a GPU per process under torchrun)."""
    student = dataclasses.replace(
        config.student, device=process_device(config.student.device, processes)
    )
    teacher = dataclasses.replace(
        config.teacher, device=process_device(config.teacher.device, processes)
    )
    datasets = [
        d
        if d.teacher is None
        else dataclasses.replace(
            d,
            teacher=dataclasses.replace(
                d.teacher, device=process_device(d.teacher.device, processes)
            ),
        )
        for d in config.datasets
    ]
    return dataclasses.replace(config, student=student, teacher=teacher, datasets=datasets)


def check_processes(config: Config, processes: int) -> str:
    """What must hold among ``processes`` processes, checked before any model loads; the parallel
    mode."""
    training = config.training
    if training.dist_backend == "nccl":
        resolve_backend("nccl", resolve_device(config.student.device))
    parallel = resolve_parallel(training.parallel, processes)
    problem = rank_split_problem(step_group_sizes(config), training.num_substeps, processes)
    if problem:
        raise ConfigError(
            "datasets: each step's groups (groups_per_batch x group_size per dataset) are shared "
            f"out in whole groups, into world size ({processes}) x training.num_substeps "
            f"({training.num_substeps}) equal parts, and {problem}; change groups_per_batch or the "
            "number of processes"
        )
    if problem := tensor_parallel_problem(config.student, processes):
        raise ConfigError(f"student.sampler_options.tensor_parallel_size: {problem}")
    if problem := engine_layout_problem(config.student, processes):
        raise ConfigError(f"student.sampler_options: {problem}")
    return parallel


def shards_its_teacher(config: Config, parallel: str) -> bool:
    """Whether the run's local teacher is sharded with the student (FSDP), not replicated.

    A sharded teacher's forwards are collectives, so it is sharded only where every process
    calls it alike: one teacher for every dataset, local, reading the student's tokens, scoring
    on-policy batches on the main thread, and not asked for its full distribution (``jsd``
    applies the teacher's lm head outside its forward).
    """
    teachers = {id(config.teacher_for(d)) for d in config.datasets}
    teacher = config.teacher_for(config.datasets[0])
    training = config.training
    return (
        parallel_modes()[parallel].shards
        and len(teachers) == 1
        and teacher.backend == "local"
        and teacher.mixture is None
        and not teacher.cross_tokenizer
        and training.objective.teacher_signal != "distribution"
        and training.data_source == "student"
        and training.max_staleness == 0
    )


def launch(config: Config, processes: int, arguments: list[str]) -> None:
    """``opd train --nproc N``: ``opd train ARGUMENTS`` under torchrun on this node, once
    ``config`` is known to fit N processes; its exit status kept. SIGTERM is passed on (it was
    sent to this process alone); Ctrl-C already reaches the whole process group."""
    check_processes(config, processes)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += [f"--nproc_per_node={processes}", "-m", "opd", "train", *arguments]
    job = subprocess.Popen(command)
    received: list[int] = []

    def forward(number: int, frame) -> None:
        received.append(number)
        if number == signal.SIGTERM:
            job.send_signal(number)

    for number in (signal.SIGTERM, signal.SIGINT):
        signal.signal(number, forward)
    status = job.wait()
    if received:
        name = signal.Signals(received[0]).name
        print(
            f"opd: stopped by {name} (torchrun exit status {status}). Run the same command again "
            "to resume from the last checkpoint",
            file=sys.stderr,
        )
        raise SystemExit(128 + received[0])
    if status:
        print(
            f"opd: error: a training process failed (torchrun exit status {status}; its report is "
            "above). Run the same command again to resume from the last checkpoint.",
            file=sys.stderr,
        )
        raise SystemExit(status)
