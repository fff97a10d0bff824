"""Rollout servers with collection ahead: seconds per step with ``max_staleness: 1`` against 0, the
server on a core of its own and the trainer on the other (``taskset``), measured in one run.

One vLLM rollout server (SmolLM2-135M-Instruct, float32, opd's weight backend) is started pinned to
``--server-cores``; the trainer runs pinned to ``--trainer-cores`` with ``student.sampler:
vllm_server``, full fine-tuning, reasoning-gym ``chain_sum`` prompts and a teacher that disagrees
(the same model with noise of 0.05 its weights' std), first synchronously, then collecting one
step ahead. Per run: the median of steps 2.. of ``time/total`` (which, collecting ahead, holds only
the wait for the batch and the update) and the wall seconds per step over the whole run.

    python bench/smollm2.py      # once: the converted model
    python bench/rollout_overlap.py --out docs/results/rollout_overlap.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml
from local_server import free_port, wait_for_health
from provenance import write_result
from smollm2 import converted_dir
from vllm_sync import perturbed_teacher


def start_server(model: Path, port: int, cores: str, log: Path) -> subprocess.Popen:
    command = [
        "taskset", "-c", cores, sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model), "--served-model-name", "student", "--dtype", "float32",
        "--max-model-len", "1024", "--host", "127.0.0.1", "--port", str(port),
        "--logprobs-mode", "processed_logprobs", "--generation-config", "vllm",
        "--weight-transfer-config", '{"backend": "opd_safetensors"}',
    ]  # fmt: skip
    threads = str(len(cores.split(",")))
    env = os.environ | {
        "VLLM_SERVER_DEV_MODE": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "OMP_NUM_THREADS": threads,
    }
    server = subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)
    wait_for_health(server, port, timeout_s=600, why_exited=lambda: log.read_text()[-3000:])
    return server


def run(staleness: int, url: str, student: Path, teacher: Path, args) -> tuple[dict, dict]:
    with tempfile.TemporaryDirectory() as directory:
        config = {
            "log_path": str(Path(directory) / "run"),
            "seed": args.seed,
            "eval_every": 0,
            "save_every": 0,
            "student": {
                "model": str(student),
                "lora_rank": 0,
                "sampler": "vllm_server",
                "rollout_servers": [url],
            },
            "teacher": {"model": str(teacher)},
            "datasets": [
                {
                    "name": "chain_sum",
                    "source": "reasoning_gym:chain_sum",
                    "task_config": {
                        "min_terms": 2,
                        "max_terms": 2,
                        "min_digits": 1,
                        "max_digits": 1,
                    },
                    "groups_per_batch": args.prompts,
                    "group_size": args.group_size,
                }
            ],
            "training": {
                "learning_rate": 1e-5,
                "max_tokens": args.max_tokens,
                "max_steps": args.steps,
                "max_staleness": staleness,
            },
        }
        path = Path(directory) / "run.yaml"
        path.write_text(yaml.safe_dump(config))
        threads = str(len(args.trainer_cores.split(",")))
        started = time.perf_counter()
        done = subprocess.run(
            [
                "taskset",
                "-c",
                args.trainer_cores,
                sys.executable,
                "-m",
                "opd",
                "train",
                str(path),
                "--no-progress",
            ],
            capture_output=True,
            text=True,
            env=os.environ | {"OMP_NUM_THREADS": threads},
        )
        wall = time.perf_counter() - started
        if done.returncode != 0:
            raise SystemExit(f"max_staleness {staleness} failed:\n{done.stderr[-3000:]}")
        rows = [json.loads(line) for line in (Path(directory) / "run" / "metrics.jsonl").open()]
        spans = [json.loads(line) for line in (Path(directory) / "run" / "timing.jsonl").open()]
    ends = sorted(span["end"] for span in spans if span["name"] == "train")
    between = [later - earlier for earlier, later in itertools.pairwise(ends)][1:]  # steps 3.. on
    timed = [r for r in rows if "time/train" in r][2:]
    result = {
        "step_s": statistics.median(between),
        "train_s": statistics.median(r["time/train"] for r in timed),
        "wait_for_batch_s": statistics.median(
            r.get("time/wait_for_batch", r["time/sample"]) for r in timed
        ),
        "wall_s": wall,
        "rows": rows,
    }
    return result, config


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--server-cores", default="0")
    parser.add_argument("--trainer-cores", default="1")
    parser.add_argument(
        "--out", type=Path, help="also write the results here as JSON, with their provenance"
    )
    args = parser.parse_args()
    student = converted_dir()
    teacher = perturbed_teacher(student, 0.05)
    port = free_port()
    with tempfile.TemporaryDirectory() as directory:
        server = start_server(student, port, args.server_cores, Path(directory) / "server.log")
        try:
            results, configs = {}, {}
            for staleness in (0, 1):
                results[staleness], configs[staleness] = run(
                    staleness, f"http://127.0.0.1:{port}", student, teacher, args
                )
        finally:
            server.terminate()
            server.wait(timeout=60)
    print(f"{'max_staleness':>13} {'s/step':>7} {'train s':>8} {'batch wait s':>12}")
    for staleness, r in results.items():
        print(
            f"{staleness:>13} {r['step_s']:7.2f} {r['train_s']:8.2f} {r['wait_for_batch_s']:12.2f}"
        )
    ratio = results[1]["step_s"] / results[0]["step_s"]
    print(f"max_staleness 1 / 0, seconds per step: {ratio:.2f} (target <= 0.7)")
    write_result(
        args.out,
        "bench/rollout_overlap.py",
        vars(args) | {"configs": configs},
        results,
        ratio=ratio,
    )


if __name__ == "__main__":
    main()
