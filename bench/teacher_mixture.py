"""Two teachers mixed token by token, against each alone and against routing by prompt family.

Two families of one-digit arithmetic prompts, sums (the sample-efficiency bench's ``short`` task)
and products (``products``), each with a teacher fine-tuned on that family alone (SmolLM2-135M-
Instruct after SFT on the family's worked answers, cached by ``bench/sample_efficiency.py``). The
student (the untuned SmolLM2, opd's defaults: LoRA, ``sampled_reverse_kl``) trains on both
families at once, 2 prompts x 4 samples of each a step (16 completions, the single-task
defaults' budget), taught by:

- ``sums-teacher``, ``products-teacher``: one of the two teachers on both families;
- ``routing``: each family its own teacher (a dataset's ``teacher``: what every multi-teacher
  system does);
- ``mixture``: ``teacher.mixture``, both teachers at weight 0.5, on both families.

Held-out accuracy (the share of answers whose last number is right) on 48 prompts of each family
at step 0 and every ``--eval-every`` steps; the mean of the two families is the figure compared.
Each teacher's own accuracy on both families is measured once (``teachers.json``).

    python bench/teacher_mixture.py --seeds 0 1 2 --out docs/results/teacher_mixture
    python bench/teacher_mixture.py --report-only --out docs/results/teacher_mixture
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import yaml
from provenance import environment, git_commit
from sample_efficiency import SWEEP, cache_root, prepare_teacher, task_files
from smollm2 import converted_dir

ROOT = Path(__file__).resolve().parents[1]
FAMILIES = ("short", "products")
"""Sums and products: the two halves, each with a teacher fine-tuned on it alone."""
METHODS = ("sums-teacher", "products-teacher", "routing", "mixture")
EVAL_PROMPTS = 48
GROUPS_PER_FAMILY = 2


def teacher_section(method: str, teachers: dict[str, Path]) -> tuple[dict, dict[str, dict]]:
    """The run's top-level ``teacher`` and each family's own (routing), for one method."""
    if method == "sums-teacher":
        return {"model": str(teachers["short"])}, {}
    if method == "products-teacher":
        return {"model": str(teachers["products"])}, {}
    if (
        method == "routing"
    ):  # the top-level teacher is required, and unused: every family has its own
        own = {family: {"model": str(teachers[family])} for family in FAMILIES}
        return {"model": str(teachers["short"])}, own
    members = [{"model": str(teachers[family]), "weight": 0.5} for family in FAMILIES]
    return {"mixture": members}, {}


def run_data(
    log_path: Path, student: Path, teachers: dict[str, Path], method: str, seed: int, args
) -> dict:
    """A user's config of one run: both families' prompts, the method's teachers, opd's defaults."""
    specs = yaml.safe_load(SWEEP.read_text())["tasks"]
    top, own = teacher_section(method, teachers)
    datasets = []
    for family in FAMILIES:
        train_file, test_file = task_files(family, specs[family])
        dataset = {
            "name": family,
            "source": str(train_file),
            "groups_per_batch": GROUPS_PER_FAMILY,
            "eval_source": str(test_file),
            "eval_num_prompts": EVAL_PROMPTS,
            "grader": specs[family]["grader"],
        }
        if family in own:
            dataset["teacher"] = own[family]
        datasets.append(dataset)
    data = {
        "log_path": str(log_path),
        "on_existing_log_path": "overwrite",
        "seed": seed,
        "save_every": 0,
        "eval_every": args.eval_every,
        "student": {"model": str(student)},
        "datasets": datasets,
        "training": {
            "max_steps": args.steps,
            "max_tokens": max(specs[f]["max_tokens"] for f in FAMILIES),
        },
        "teacher": top,
    }
    return data


def curve(metrics: list[dict]) -> list[dict]:
    """Each evaluation's accuracy per family and their mean."""
    points = []
    for row in metrics:
        if all(f"test/{family}/accuracy" in row for family in FAMILIES):
            point = {"step": row["step"]} | {
                family: row[f"test/{family}/accuracy"] for family in FAMILIES
            }
            point["mean"] = statistics.fmean(point[family] for family in FAMILIES)
            points.append(point)
    return points


def teacher_accuracies(student: Path, teachers: dict[str, Path], args) -> dict:
    """Each teacher's held-out accuracy on both families (the same evaluation as the runs')."""
    from opd.config import config_from_dict, config_to_dict
    from opd.saved.evaluate import evaluate_run

    found = {}
    for name, model in teachers.items():
        directory = cache_root() / "runs" / f"teacher-mixture-eval-{os.getpid()}"
        directory.mkdir(parents=True, exist_ok=True)
        data = run_data(directory, model, teachers, "sums-teacher", 0, args)
        data["student"]["lora_rank"] = 0
        (directory / "config.yaml").write_text(
            yaml.safe_dump(config_to_dict(config_from_dict(data)))
        )
        record = evaluate_run(directory, base=True)
        found[name] = {family: record[f"test/{family}/accuracy"] for family in FAMILIES}
        shutil.rmtree(directory, ignore_errors=True)
    return found


def report(results: list[dict], teachers: dict | None) -> str:
    """Per method: each seed's mean accuracy at every evaluation, then the mean over seeds and
    each family's share at the last step."""
    lines = ["# Teacher mixture vs each teacher alone vs routing by family\n"]
    if teachers:
        lines.append(
            "Teachers' held-out accuracy: "
            + "; ".join(
                f"{name} teacher: sums {acc['short']:.1%}, products {acc['products']:.1%}"
                for name, acc in teachers.items()
            )
            + "\n"
        )
    steps = sorted({p["step"] for r in results for p in r["curve"]})
    lines += [
        "Mean of the two families' held-out accuracy (share of right answers, 48 prompts each).\n",
        "| method | seeds | "
        + " | ".join(f"step {s}" for s in steps)
        + " | sums at end | products at end |",
        "|---|---|" + "---|" * (len(steps) + 2),
    ]
    for method in METHODS:
        runs = [r for r in results if r["method"] == method]
        if not runs:
            continue

        def mean_at(step: int, key: str = "mean", runs: list[dict] = runs) -> str:
            values = [p[key] for r in runs for p in r["curve"] if p["step"] == step]
            return f"{statistics.fmean(values):.1%}" if len(values) == len(runs) else "-"

        seeds = ",".join(str(r["seed"]) for r in sorted(runs, key=lambda r: r["seed"]))
        cells = [mean_at(s) for s in steps] + [
            mean_at(steps[-1], "short"),
            mean_at(steps[-1], "products"),
        ]
        lines.append(f"| {method} | {seeds} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Each run:",
        "",
        "| method | seed | " + " | ".join(f"step {s}" for s in steps) + " |",
    ]
    lines.append("|---|---|" + "---|" * len(steps))
    for run in sorted(results, key=lambda r: (METHODS.index(r["method"]), r["seed"])):
        by_step = {p["step"]: p["mean"] for p in run["curve"]}
        cells = [f"{by_step[s]:.1%}" if s in by_step else "-" for s in steps]
        lines.append(f"| {run['method']} | {run['seed']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--methods", nargs="*", default=list(METHODS), choices=METHODS)
    parser.add_argument("--seeds", type=int, nargs="*", default=[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "teacher_mixture")
    parser.add_argument("--report-only", action="store_true")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    teachers_file = args.out / "teachers.json"
    if not args.report_only:
        from opd.config import config_from_dict, config_to_dict
        from opd.trainer.loop import train

        student, specs = converted_dir(), yaml.safe_load(SWEEP.read_text())["tasks"]
        build = SimpleNamespace(seed=0, eval_every=10, steps=40)
        teachers = {
            family: prepare_teacher(family, specs[family], student, build)[0] for family in FAMILIES
        }
        if not teachers_file.exists():
            measured = teacher_accuracies(student, teachers, args)
            teachers_file.write_text(
                json.dumps({"commit": git_commit(ROOT), "accuracy": measured}, indent=1) + "\n"
            )
        for seed in args.seeds:
            for method in args.methods:
                result_file = args.out / f"{method}-seed{seed}-{args.steps}steps.json"
                if result_file.exists():
                    continue
                directory = cache_root() / "runs" / f"teacher-mixture-{os.getpid()}"
                config = config_from_dict(
                    run_data(directory, student, teachers, method, seed, args)
                )
                started = time.perf_counter()
                metrics = train(config, progress=True).metrics
                shutil.rmtree(directory, ignore_errors=True)
                result = {
                    "bench": "bench/teacher_mixture.py",
                    "command": " ".join([Path(sys.executable).name, *sys.argv]),
                    "commit": git_commit(ROOT),
                    "environment": environment(),
                    "method": method,
                    "seed": seed,
                    "teachers": {family: str(path) for family, path in teachers.items()},
                    "config": config_to_dict(config),
                    "curve": curve(metrics),
                    "metrics": [
                        {"step": r["step"]}
                        | {k: v for k, v in r.items() if k.startswith(("teacher_kl", "entropy"))}
                        for r in metrics
                    ],
                    "wall_seconds": time.perf_counter() - started,
                }
                result_file.write_text(json.dumps(result, indent=1) + "\n")
                print(json.dumps({"run": result_file.stem, "curve": result["curve"]}), flush=True)
    results = [json.loads(p.read_text()) for p in sorted(args.out.glob("*-seed*.json"))]
    teachers = json.loads(teachers_file.read_text())["accuracy"] if teachers_file.exists() else None
    tables = report(results, teachers)
    (args.out / "teacher_mixture.md").write_text(tables + "\n")
    print(tables)


if __name__ == "__main__":
    main()
