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
        "datasets": [{"name": "rev", "source": str(prompts), "groups_per_batch": 2, "group_size": 2}],
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
    parser.add_argument("--max-staleness", type=int, default=0, help="training.max_staleness of the runs")
    parser.add_argument("--out", type=Path, help="also write the results here as JSON, with their provenance")
    args = parser.parse_args()
    test_faults.STEPS = args.steps
    chance = random.Random(args.seed)
    with tempfile.TemporaryDirectory() as directory:
        root = Path(directory)
        config = base_config(root)
        config["training"]["max_staleness"] = args.max_staleness
        config_path = test_faults.write_config(config, root / "run.yaml", root / "run", save_every=1)
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
    results = {
        "kills": kills,
        "processes_started": restarts,
        "kills_by_phase": dict(where),
        "every_finished_run_equal_to_the_reference": verified_kill_runs,
        "sigterm": terms,
    }
    print(json.dumps(results, indent=1))
    write_result(args.out, "bench/fault_campaign.py", vars(args), results)


if __name__ == "__main__":
    main()
