"""How much `opd demo`'s result depends on which student its warm-up happens to build.

Another CPU or torch build rounds differently and grows a different student from the same
seed; here different student seeds stand in for that. Every seed shares the demo's teacher,
builds its student with the demo's own recipe, then runs the demo's distillation and scores
it as the demo does (held-out greedy accuracy, sampled teacher KL).

    python bench/demo_robustness.py                          # student seeds 1-8, 200 steps
    python bench/demo_robustness.py --seeds 1 2 3 --steps 400
    python bench/demo_robustness.py --set training.learning_rate=3e-4
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from pathlib import Path

from provenance import write_result

from opd.config import apply_overrides
from opd.demo import run as demo


def with_overrides(overrides: list[str]):
    """``demo.demo_config`` with the run's ``dotted.key=value`` overrides applied, as ``opd train``
    does."""
    original = demo.demo_config

    def config(*args, **kwargs) -> dict:
        return apply_overrides(original(*args, **kwargs), overrides)

    return config


def run_figures(run_dir: Path) -> dict:
    """From the run's metrics: how far the sampler's log-probs were from the trainer's
    (``kl_sample_train``, mean and largest over the steps) and the held-out teacher KL at each
    evaluation."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    gaps = [abs(row["kl_sample_train"]) for row in rows if "kl_sample_train" in row]
    curve = {
        row["step"]: row[key]
        for row in rows
        for key in row
        if key.startswith("test/") and key.endswith("/teacher_kl")
    }
    return {
        "kl_sample_train_mean": sum(gaps) / len(gaps),
        "kl_sample_train_max": max(gaps),
        "test_teacher_kl": curve,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=list(range(1, 9)))
    parser.add_argument(
        "--steps", type=int, default=200, help="the end-to-end test's 200 by default"
    )
    parser.add_argument("--set", nargs="*", default=[], metavar="DOTTED.KEY=VALUE")
    parser.add_argument(
        "--work-dir", default=None, help="models and runs (default: a new temp dir)"
    )
    parser.add_argument(
        "--out", type=Path, help="also write the results here as JSON, with their provenance"
    )
    args = parser.parse_args()
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="opd-demo-robustness-"))
    demo.demo_config = with_overrides(args.set)

    os.environ["OPD_CACHE"] = str(work / "teacher-cache")
    teacher = demo.ensure_model("teacher", demo.TEACHER_SPEC, seed=0, log=print)
    print(f"{args.steps} steps, overrides {args.set or 'none'}; models and runs in {work}")
    print(
        f"{'seed':>4} {'acc before':>10} {'acc after':>9} {'KL before':>9} {'KL after':>8} "
        f"{'KL cut':>6}"
    )
    rows = []
    for seed in args.seeds:
        os.environ["OPD_CACHE"] = str(work / f"seed{seed}")
        if not (demo.cache_dir() / "teacher").exists():
            shutil.copytree(teacher, demo.cache_dir() / "teacher")
        silent = {"log": lambda *_: None}
        demo.ensure_model("student", demo.STUDENT_SPEC, seed=seed, **silent)
        run_dir = work / f"run-seed{seed}"
        shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run, not a resume of an earlier one
        results = demo.run_demo(
            log_path=str(run_dir), steps=args.steps, seed=0, progress=False, **silent
        )
        before, after = results["student before"], results["student after"]
        print(
            f"{seed:>4} {before['accuracy']:>10.1%} {after['accuracy']:>9.1%} "
            f"{before['teacher_kl']:>9.3f} {after['teacher_kl']:>8.3f} "
            f"{before['teacher_kl'] / after['teacher_kl']:>5.1f}x",
            flush=True,
        )
        rows.append({"seed": seed, "before": before, "after": after} | run_figures(run_dir))
    write_result(args.out, "bench/demo_robustness.py", vars(args) | {"work_dir": str(work)}, rows)


if __name__ == "__main__":
    main()
