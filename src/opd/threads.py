"""How many threads torch computes with on a CPU: the user's setting when there is one, else the
cores no other process is using when the command starts.

Torch's default is a thread per core. Beside another busy process that stalls: its threads wait
for each other at every parallel region, and one of them is always waiting for a core the other
process holds (two 2-thread jobs on 2 cores ran 60x slower). Counting the idle cores takes a
quarter of a second; a job that starts later is not seen, and the count is not changed mid-run
(a thread count changes how sums are split, so a resumed run would part from an uninterrupted one
by rounding): set ``OMP_NUM_THREADS`` for runs that must resume bit for bit on a busy machine.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

USER_SETTINGS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
"""Environment variables through which a user chooses torch's thread count."""
SAMPLE_S = 0.25
"""How long the other processes' CPU use is watched before choosing."""
CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def available_cores() -> int:
    """Cores this process may run on (its CPU affinity, as a container or taskset limits it)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _busy_and_total_ticks() -> tuple[int, int] | None:
    """The machine's busy and total CPU time so far, from /proc/stat (Linux)."""
    try:
        fields = [
            int(value) for value in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
        ]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    total = sum(fields[:8])  # user nice system idle iowait irq softirq steal (guest is in user)
    return total - idle, total


def cores_busy_elsewhere(sample_s: float = SAMPLE_S) -> float:
    """How many cores other processes kept busy over ``sample_s`` seconds (this one's own use
    subtracted); where /proc/stat is absent, the load average."""
    first, own = _busy_and_total_ticks(), time.process_time()
    if first is None:
        return os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    time.sleep(sample_s)
    second, own = _busy_and_total_ticks(), time.process_time() - own
    busy_ticks, total_ticks = second[0] - first[0], second[1] - first[1]
    if total_ticks <= 0:
        return 0.0
    machine_cores = total_ticks / (CLOCK_TICKS * sample_s)  # every core, not only ours
    busy = busy_ticks / total_ticks * machine_cores
    return max(0.0, busy - own / sample_s)


def threads_for_idle_cores(cores: int, busy_elsewhere: float) -> int:
    """One thread per core nobody else is using, at least one."""
    return max(1, min(cores, cores - round(busy_elsewhere)))


def choose_threads() -> str | None:
    """Set torch's thread count unless the user set it; a line saying so when fewer than the
    cores, since a slower run should say why (None otherwise)."""
    if any(os.environ.get(key) for key in USER_SETTINGS) or "vllm" in sys.modules:
        return None  # the user's choice; or vLLM's CPU backend, which binds the threads itself
    import torch

    cores = available_cores()
    busy = cores_busy_elsewhere()
    threads = threads_for_idle_cores(cores, busy)
    if threads != torch.get_num_threads():
        torch.set_num_threads(threads)
    if threads < cores:
        return (
            f"opd: computing with {threads} of {cores} cores: other processes keep {busy:.1f} busy "
            "(two jobs on the same cores stall each other); OMP_NUM_THREADS chooses"
        )
    return None
