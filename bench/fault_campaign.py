"""SIGKILL at random points over many runs, and SIGTERM at random points, on the tests' tiny models.

One config (the test suite's tiny student and teacher, 2 prompts x 2 samples, 12 steps,
checkpoint every step) is trained once undisturbed in this process: the reference. Then,
``--kills`` times, ``opd train`` is started on the same log path and SIGKILLed after a random
delay once it has written its next metrics row (so kills land anywhere: sampling, scoring,
update, metrics write, checkpoint write); and ``--terms`` times, a fresh run is sent SIGTERM at
a random moment within its steps and must stop with exit status 143 after checkpointing (or,
if it got there first, finish). Where each kill landed
is read from what the run left: a half-written ``checkpoints/.tmp-*`` directory means inside a
checkpoint write, otherwise the phase after the last span in ``timing.jsonl``. Every
interrupted run is finished by running the same command again; its metrics must equal the
reference's row for row and its final weights equal the reference's.

``--max-staleness k`` runs the same with collection ahead (the batches in collection when a
checkpoint is saved are collected again on resume from the weights it kept for them).

    python bench/fault_campaign.py --out docs/results/fault_campaign.json
    python bench/fault_campaign.py --max-staleness 1 --out docs/results/fault_campaign_ahead1.json
    python bench/fault_campaign.py --kills 0 --terms 0 --replica-kills 20 \
        --out docs/results/fault_campaign_replicas.json

``--replica-kills N`` runs N more runs whose teacher is the tiny teacher behind two ``opd serve``
replicas, one of them (drawn at random) SIGKILLed at a random moment of the run (anywhere in
its steps: while a request is in flight or between requests) and started again before the next
run; every run must finish all its steps, each step's teacher KL equal to the same run's
against one server within 1e-5.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import signal
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from provenance import write_result

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests import test_faults
from tests.conftest import tiny_llama

NEXT_PHASE = {
    "sample": "teacher scoring",
    "teacher": "update",
    "train": "metrics / checkpoint",
    "checkpoint": "sampling",
}


def base_config(root: Path) -> dict:
    from opd.demo.char_tokenizer import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    paths = {}
    for name, seed in (("student", 1), ("teacher", 2)):
        paths[name] = root / name
        tiny_llama(len(tokenizer), seed=seed).save_pretrained(paths[name])
        tokenizer.save_pretrained(paths[name])
    prompts = root / "prompts.jsonl"
    words = ("abc", "hgf", "dcea", "bbad", "gah", "fed")
    prompts.write_text(
        "".join(json.dumps({"prompt": f"reverse {w}", "answer": w[::-1]}) + "\n" for w in words)
    )
    return {
        "seed": 0,
        "student": {"model": str(paths["student"]), "lora_rank": 0},
        "teacher": {"model": str(paths["teacher"])},
        "datasets": [
            {"name": "rev", "source": str(prompts), "groups_per_batch": 2, "group_size": 2}
        ],
        "training": {"learning_rate": 1e-3, "max_tokens": 6, "max_steps": 2},
    }


def landed(log_path: Path) -> str:
    if list((log_path / "checkpoints").glob(".tmp-*")):
        return "checkpoint write"
    spans = log_path / "timing.jsonl"
    lines = spans.read_text().splitlines() if spans.exists() else []
    if not lines:
        return "start-up"
    try:
        return NEXT_PHASE.get(json.loads(lines[-1]).get("name"), "other")
    except json.JSONDecodeError:
        return "timing write"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--kills", type=int, default=30)
    parser.add_argument("--terms", type=int, default=5)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--max-staleness", type=int, default=0, help="training.max_staleness of the runs"
    )
    parser.add_argument(
        "--replica-kills", type=int, default=0, help="runs with a teacher replica killed"
    )
    parser.add_argument(
        "--out", type=Path, help="also write the results here as JSON, with their provenance"
    )
    args = parser.parse_args()
    test_faults.STEPS = args.steps
    chance = random.Random(args.seed)
    with tempfile.TemporaryDirectory() as directory:
        root = Path(directory)
        config = base_config(root)
        config["training"]["max_staleness"] = args.max_staleness
        config_path = test_faults.write_config(
            config, root / "run.yaml", root / "run", save_every=1
        )
        reference = test_faults.reference_run(config_path, root)
        log_path, where, kills, restarts = root / "run", Counter(), 0, 0
        while kills < args.kills:
            if test_faults.rows_written(log_path) >= args.steps:
                shutil.rmtree(log_path)  # a finished run: start another one to kill
            process = test_faults.start(config_path)
            restarts += 1
            test_faults.wait_for_rows(process, log_path, test_faults.rows_written(log_path) + 1)
            time.sleep(chance.uniform(0.0, 0.5))
            if process.poll() is not None:
                continue
            process.kill()
            process.wait()
            where[landed(log_path)] += 1
            kills += 1
            if chance.random() < 0.3 or kills == args.kills:  # finish some runs and compare them
                test_faults.finish(config_path)
                test_faults.assert_undisturbed(log_path, reference)
        verified_kill_runs = True
        terms = []
        for _ in range(args.terms):
            shutil.rmtree(log_path, ignore_errors=True)
            process = test_faults.start(config_path)
            test_faults.wait_for_rows(process, log_path, 1)
            time.sleep(chance.uniform(0.0, 0.3))  # the run's 12 steps take about 1.5 s here
            stopped_at = time.perf_counter()
            process.send_signal(signal.SIGTERM)
            _, stderr = process.communicate(timeout=120)
            seconds = time.perf_counter() - stopped_at
            terms.append(
                {
                    "status": process.returncode,
                    "seconds_to_stop": seconds,
                    "finished_first": "stopped by" not in stderr,
                }
            )
            test_faults.finish(config_path)
            test_faults.assert_undisturbed(log_path, reference)
        replicas = replica_kills(root, config, args.replica_kills, args.steps, chance)
    results = {
        "replica_kills": replicas,
        "kills": kills,
        "processes_started": restarts,
        "kills_by_phase": dict(where),
        "every_finished_run_equal_to_the_reference": verified_kill_runs,
        "sigterm": terms,
    }
    print(json.dumps(results, indent=1))
    write_result(args.out, "bench/fault_campaign.py", vars(args), results)


def replica_kills(root: Path, config: dict, runs: int, steps: int, chance: random.Random) -> dict:
    """``runs`` runs on two teacher replicas, a random one killed at a random moment of each."""
    import threading

    from opd.config import config_from_dict
    from opd.runs.metrics import read_jsonl
    from opd.trainer.loop import Trainer
    from tests.servers import free_port, start_opd_serve

    if not runs:
        return {}
    teacher_dir = config["teacher"]["model"]
    ports = [free_port(), free_port()]
    servers = [start_opd_serve(teacher_dir, port) for port in ports]

    def run(urls: list[str], name: str) -> tuple[list[dict], float]:
        remote = {
            "model": "teacher",
            "backend": "openai",
            "base_url": urls,
            "tokenizer": teacher_dir,
        }
        data = dict(config, log_path=str(root / name), teacher=remote | {"request_batch_size": 1})
        data["training"] = dict(config["training"], max_steps=steps, max_staleness=0)
        started = time.perf_counter()
        Trainer(config_from_dict(data), progress=False).run()
        return read_jsonl(root / name / "metrics.jsonl"), time.perf_counter() - started

    outcomes = []
    try:
        reference, seconds = run([f"http://127.0.0.1:{ports[0]}/v1"], "replica-reference")
        for number in range(runs):
            victim, delay = chance.randrange(2), chance.uniform(0.0, seconds)
            timer = threading.Timer(delay, servers[victim].kill)
            timer.start()
            rows, _ = run([f"http://127.0.0.1:{port}/v1" for port in ports], f"replicas-{number}")
            timer.join()
            servers[victim].wait()
            equal = len(rows) == len(reference) and all(
                abs(a["teacher_kl"] - b["teacher_kl"]) <= 1e-5
                for a, b in zip(rows, reference, strict=True)
            )
            outcomes.append(
                {
                    "killed": victim,
                    "after_s": delay,
                    "steps": len(rows),
                    "equal_to_one_server": equal,
                    "replicas_live_at_end": rows[-1].get("teacher/replicas_live") if rows else None,
                }
            )
            print(json.dumps(outcomes[-1]), flush=True)
            servers[victim] = start_opd_serve(teacher_dir, ports[victim])
    finally:
        for server in servers:
            server.kill()
            server.wait()
    return {
        "runs": len(outcomes),
        "finished_every_step": sum(o["steps"] == steps for o in outcomes),
        "equal_to_one_server": sum(o["equal_to_one_server"] for o in outcomes),
        "steps_lost": sum(steps - o["steps"] for o in outcomes),
        "reference_seconds": seconds,
        "runs_detail": outcomes,
    }


if __name__ == "__main__":
    main()
