"""vLLM rollouts under torchrun: step time, weight-sync time and peak memory of 2 processes sampling
with vLLM, against 1 process with vLLM and against 2 processes with the HF engine, at equal global
work (the same global batch, tokens and steps), all in one run of this script, one after another.

Each layout trains SmolLM2-135M-Instruct (full fine-tune under FSDP2 when there are 2 processes)
with ``opd train`` (``--nproc 2`` for two), reasoning-gym ``chain_sum`` prompts and a teacher that
disagrees (the same model with noise of 0.05 its weights' std). Per layout: the median over steps
2.. of rank 0's ``time/total``, ``time/sample`` and ``time/weight_sync`` (the sync's share of the
step), the largest ``|kl_sample_train|``, and the peak resident memory of the whole job (the sum
over its processes, sampled every 0.1 s from /proc) and of its largest process.

    python bench/smollm2.py      # once: the converted model
    python bench/vllm_processes.py --out docs/results/vllm_processes.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import yaml
from provenance import write_result
from smollm2 import converted_dir
from vllm_sync import perturbed_teacher

LAYOUTS = {
    "1 process, vLLM": (1, "vllm"),
    "2 processes, vLLM": (2, "vllm"),
    "2 processes, HF": (2, "hf"),
}


def descendants(pid: int) -> list[int]:
    """``pid`` and every process below it (read from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(parent, []).append(int(entry.name))
    found, stack = [], [pid]
    while stack:
        current = stack.pop()
        found.append(current)
        stack += children.get(current, [])
    return found


def resident_bytes(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class PeakMemory:
    """The largest total and per-process resident memory of a job, sampled on a thread."""

    def __init__(self, pid: int):
        self.pid, self.total, self.largest = pid, 0, 0
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._watch, daemon=True)
        self.thread.start()

    def _watch(self) -> None:
        while not self.done.wait(0.1):
            sizes = [resident_bytes(p) for p in descendants(self.pid)]
            self.total, self.largest = max(self.total, sum(sizes)), max(self.largest, max(sizes))

    def stop(self) -> None:
        self.done.set()
        self.thread.join()


def config(student: Path, teacher: Path, sampler: str, log_path: Path, args) -> dict:
    return {
        "log_path": str(log_path),
        "seed": args.seed,
        "eval_every": 0,
        "save_every": 0,
        "student": {
            "model": str(student),
            "lora_rank": 0,
            "sampler": sampler,
            **({"sampler_options": {"max_model_len": 512}} if sampler == "vllm" else {}),
        },
        "teacher": {"model": str(teacher)},
        "datasets": [
            {
                "name": "chain_sum",
                "source": "reasoning_gym:chain_sum",
                "task_config": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1},
                "groups_per_batch": args.prompts,
                "group_size": args.group_size,
            }
        ],
        "training": {"learning_rate": 1e-5, "max_tokens": args.max_tokens, "max_steps": args.steps},
    }


def run(name: str, student: Path, teacher: Path, args) -> tuple[dict, dict]:
    processes, sampler = LAYOUTS[name]
    with tempfile.TemporaryDirectory() as directory:
        resolved = config(student, teacher, sampler, Path(directory) / "run", args)
        path = Path(directory) / "run.yaml"
        path.write_text(yaml.safe_dump(resolved))
        command = [sys.executable, "-m", "opd", "train", str(path), "--no-progress"]
        if processes > 1:
            command.append(f"--nproc={processes}")
        started = time.perf_counter()
        job = subprocess.Popen(
            command,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env=os.environ | {"OMP_NUM_THREADS": str(args.threads_per_process)},
        )
        memory = PeakMemory(job.pid)
        _, stderr = job.communicate()
        memory.stop()
        wall = time.perf_counter() - started
        if job.returncode != 0:
            raise SystemExit(f"{name} failed:\n{stderr[-3000:]}")
        rows = [json.loads(line) for line in (Path(directory) / "run" / "metrics.jsonl").open()]
    timed = [r for r in rows if "time/total" in r][
        1:
    ]  # the first step pays the first sync and warm-up
    step = statistics.median(r["time/total"] for r in timed)
    sync = statistics.median(r.get("time/weight_sync", 0.0) for r in timed)
    result = {
        "step_s": step,
        "sample_s": statistics.median(r["time/sample"] for r in timed),
        "weight_sync_s": sync,
        "weight_sync_share": sync / step,
        "max_abs_kl_sample_train": max(
            abs(r["kl_sample_train"]) for r in rows if "kl_sample_train" in r
        ),
        "peak_total_gib": memory.total / 2**30,
        "peak_largest_process_gib": memory.largest / 2**30,
        "wall_s": wall,
        "rows": rows,
    }
    return result, resolved


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads-per-process", type=int, default=1)
    parser.add_argument("--layouts", nargs="*", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument(
        "--out", type=Path, help="also write the results here as JSON, with their provenance"
    )
    args = parser.parse_args()
    student = converted_dir()
    teacher = perturbed_teacher(student, 0.05)
    results, configs = {}, {}
    for name in args.layouts:
        results[name], configs[name] = run(name, student, teacher, args)
    base = results.get("1 process, vLLM")
    print(
        f"{'layout':>18} {'step s':>7} {'sample s':>9} {'sync s':>7} {'sync share':>10} "
        f"{'max|kl_s_t|':>11} {'peak GiB':>9} {'largest':>8}" + (" step vs 1 proc" if base else "")
    )
    for name, r in results.items():
        print(
            f"{name:>18} {r['step_s']:7.2f} {r['sample_s']:9.2f} {r['weight_sync_s']:7.3f} "
            f"{r['weight_sync_share']:10.1%} {r['max_abs_kl_sample_train']:11.1e} "
            f"{r['peak_total_gib']:9.2f} {r['peak_largest_process_gib']:8.2f}"
            + (f" {r['step_s'] / base['step_s']:14.2f}" if base else "")
        )
    write_result(args.out, "bench/vllm_processes.py", vars(args) | {"configs": configs}, results)


if __name__ == "__main__":
    main()
