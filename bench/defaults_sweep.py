"""Do opd's defaults work on a new model pair: learning rate x mode x seed, nothing else tuned.

Each run is what a new user writes: the student (untuned SmolLM2-135M-Instruct), its teacher
(the same model fine-tuned on the task by ``bench/sample_efficiency.py``, cached), the task's
train and held-out prompts, ``max_steps`` and the task's ``max_tokens``; every other setting
is opd's default (objective, batch, schedule, LoRA), but for the learning rate and the mode
(LoRA at the default rank, or ``full``: ``student.lora_rank=0``) the sweep varies, and ``--set`` for
a variant (``--label`` names it). Held-out greedy accuracy on the task's 48 prompts is measured at
the start, every ``--eval-every`` steps and at the end; each step's training metrics (teacher KL,
entropy, gradient norm, advantages) are kept to show how a run goes wrong.

    python bench/defaults_sweep.py --tasks short products --modes lora full --seeds 0 1 2
    python bench/defaults_sweep.py --tasks short --modes full --lrs 5e-5 --label no-warmup \\
        --set training.warmup_steps=0
    python bench/defaults_sweep.py --tasks products --modes lora --sft-steps 20 --label sft20
    python bench/defaults_sweep.py --tasks products --modes lora --sft-steps 20 --label sft20-slower
    \\
        --then-set training.learning_rate=1e-4
    python bench/defaults_sweep.py --report-only --out docs/results/defaults

``--sft-steps`` runs the published pipeline: that many steps of NLL on the teacher's samples
first (same mode and rate), then ``--steps`` on-policy from the merged result, one curve;
``--then-set`` changes the second stage only.
Each finished run is a JSON file in ``--out`` with its commit, resolved config, environment,
curve and per-step metrics; ``defaults.md`` (tables) is rebuilt from all of them. An interrupted
sweep resumes: finished runs are skipped, and a run stopped halfway goes on from its last
checkpoint (its run directory under the cache is named after it, so several sweeps, one seed
each say, can run at once).
"""

from __future__ import annotations

import argparse
import itertools
import json
import shutil
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import yaml
from provenance import environment, git_commit, relative_paths
from sample_efficiency import SWEEP, cache_root, prepare_teacher, run_config
from smollm2 import converted_dir

ROOT = Path(__file__).resolve().parents[1]
KEPT_METRICS = (
    "loss",
    "teacher_kl",
    "entropy",
    "grad_norm",
    "kl_sample_train",
    "completion_len_mean",
    "lr",
    "advantage/mean",
    "advantage/std",
    "advantage/min",
    "advantage/max",
    "on_policy",
    "lmbda",
    "reward/mean",
    "reward/group_std",
    "reward/constant_groups",
    "advantage/kl_abs_mean",
    "advantage/reward_abs_mean",
)


def user_config(
    log_path: Path, student: Path, teacher: Path, task: str, spec: dict, steps: int, args
) -> dict:
    """The sample-efficiency bench's run less what opd's defaults decide: the models, the task's
    prompts, ``max_steps`` and the task's answer length (16 tokens for an answer-only task, which
    keeps a 40-step run within minutes on a CPU); evaluation settings."""
    data = run_config(log_path, student, teacher, task, spec, args)
    del data["student"]["lora_rank"]
    for key in ("groups_per_batch", "group_size"):
        del data["datasets"][0][key]
    data["training"] = {"max_steps": steps, "max_tokens": spec["max_tokens"]}
    return data


SFT_OVERRIDES = ["training.objective=nll", "training.data_source=teacher"]
"""Stage one of the published pipeline: the student learns the teacher's own samples (NLL)."""


def train_stage(
    task: str,
    spec: dict,
    student: Path,
    teacher: Path,
    overrides: list[str],
    steps: int,
    args,
    directory: Path,
    export: Path | None,
) -> dict:
    """One ``opd`` run of ``steps`` steps in ``directory``; its resolved config, held-out curve and
    per-step training metrics; its final student merged into ``export`` when one is given. A run
    stopped halfway resumes from its last checkpoint there (the step it resumed from is kept)."""
    from opd.config import config_from_dict, config_to_dict
    from opd.runs.metrics import read_jsonl
    from opd.saved.export import export_student
    from opd.trainer.loop import train

    checkpoints = directory / "checkpoints.jsonl"
    resumed = read_jsonl(checkpoints)[-1]["step"] if checkpoints.is_file() else 0
    data = user_config(directory, student, teacher, task, spec, steps, args)
    config = config_from_dict(data, [*overrides, "on_existing_log_path=resume"])
    train(config, progress=True)
    if export is not None:
        shutil.rmtree(export, ignore_errors=True)
        export_student(directory, export, merge_lora=True)
    record = stage_record(config_to_dict(config), read_jsonl(directory / "metrics.jsonl"), task)
    return record | ({"resumed_from_step": resumed} if resumed else {})


def stage_record(config: dict, metrics: list[dict], task: str) -> dict:
    """A stage's resolved config, held-out curve and the per-step training metrics kept."""
    key = f"test/{task}/accuracy"
    return {
        "config": config,
        "curve": [
            {
                "step": row["step"],
                "accuracy": row[key],
                "score": row.get(f"test/{task}/score"),
                "teacher_kl": row.get(f"test/{task}/teacher_kl"),
            }
            for row in metrics
            if key in row
        ],
        "steps": [
            {"step": row["step"], **{k: row[k] for k in KEPT_METRICS if k in row}}
            for row in metrics
        ],
    }


def run_one(
    name: str, task: str, spec: dict, student: Path, teacher: Path, overrides: list[str], args
) -> dict:
    """One run, after ``--sft-steps`` of stage one when asked: the stages' curves and metrics
    joined on one step axis (stage two's steps follow stage one's), each stage's config kept.
    Its run directories (named after the run) stay until it is done, so the same command after
    an interruption goes on from the last checkpoint."""
    directory = cache_root() / "runs" / f"defaults-sweep-{name}"
    if not args.sft_steps:
        run = train_stage(
            task, spec, student, teacher, overrides, args.steps, args, directory, None
        )
        shutil.rmtree(directory, ignore_errors=True)
        return run
    first_directory = directory.with_name(directory.name + "-sft")
    merged = directory.with_name(directory.name + "-sft-student")
    first = train_stage(
        task, spec, student, teacher, overrides + SFT_OVERRIDES, args.sft_steps, args,
        first_directory, merged,
    )  # fmt: skip
    second = train_stage(
        task, spec, merged, teacher, overrides + args.then_set, args.steps, args, directory, None
    )
    for done in (first_directory, merged, directory):
        shutil.rmtree(done, ignore_errors=True)

    def shifted(rows: list[dict]) -> list[dict]:
        return [row | {"step": row["step"] + args.sft_steps} for row in rows]

    return {
        "config": second["config"],
        "sft_config": first["config"],
        # stage two's first evaluation is of the merged stage-one student: it stands for stage one's
        # last
        "curve": [p for p in first["curve"] if p["step"] < args.sft_steps]
        + shifted(second["curve"]),
        "steps": first["steps"] + shifted(second["steps"]),
    }


def stopped_run(directory: Path, task: str) -> dict:
    """A run directory's record as :func:`train_stage` returns it, from what it logged before it
    was stopped: its last logged step, and its wall time from the first span to the last."""
    from opd.runs.metrics import read_jsonl

    metrics = read_jsonl(directory / "metrics.jsonl")
    spans = read_jsonl(directory / "timing.jsonl")
    config = yaml.safe_load((directory / "config.yaml").read_text())
    record = stage_record(config, metrics, task)
    record["stopped_at_step"] = max(row["step"] for row in metrics)
    record["wall_seconds"] = max(s["end"] for s in spans) - min(s["start"] for s in spans)
    return record


def gap_closed(run: dict) -> float:
    """Fraction of the student's starting gap to the teacher closed by the end."""
    start, end = run["curve"][0]["accuracy"], run["curve"][-1]["accuracy"]
    return (end - start) / max(run["teacher_accuracy"] - start, 1e-9)


def report(results: list[dict]) -> str:
    """Per task: one row per label x mode x learning rate x seed (accuracy at every evaluation,
    best, gap closed, lowest entropy)."""
    lines = []
    for task in sorted({r["task"] for r in results}):
        group = sorted(
            (r for r in results if r["task"] == task),
            key=lambda r: (r["label"], r["mode"], r["learning_rate"], r["seed"]),
        )
        eval_steps = sorted({point["step"] for run in group for point in run["curve"]})
        scored = [r for r in group if r.get("teacher_score") is not None]
        score_only = [r for r in group if r.get("curve_counts") == "score"]
        counted = [r for r in group if r.get("curve_counts") != "score"]
        teacher = []
        if counted:
            run = (scored or counted)[0]
            teacher.append(f"teacher {run['teacher_accuracy']:.1%}")
            if scored:
                teacher[-1] += f" (score {run['teacher_score']:.1%})"
        if score_only:
            teacher.append(
                f"the score-only runs' teacher: score {score_only[0]['teacher_accuracy']:.1%}"
            )
        lines += [
            f"\n### {task}: {'; '.join(teacher)}\n",
            "Each cell is the share of held-out answers fully right (`test/<task>/accuracy`), and "
            "after it in brackets the mean partial credit where the run recorded it (`score`); "
            "runs marked (score only) recorded the mean partial credit alone, in their accuracy's "
            "place.\n",
            "| variant | objective | mode | learning rate | seed | "
            + " | ".join(f"step {step}" for step in eval_steps)
            + " | best | gap closed | min entropy |",
            "|---|---|---|---|---|" + "---|" * (len(eval_steps) + 3),
        ]
        for run in group:
            accuracies = [point["accuracy"] for point in run["curve"]]
            score_only = (
                run.get("curve_counts") == "score"
            )  # recorded before opd counted fully right
            by_step = {
                point["step"]: (
                    f"score {point['accuracy']:.1%}" if score_only else f"{point['accuracy']:.1%}"
                )
                + (f" ({point['score']:.1%})" if point.get("score") is not None else "")
                for point in run["curve"]
            }
            objective = run["config"]["training"]["objective"]
            name = objective["name"] + (f" (k {objective['topk']})" if "topk" in objective else "")
            entropy = min(
                (row["entropy"] for row in run["metrics"] if "entropy" in row), default=float("nan")
            )
            lines.append(
                f"| {run['label']}{' (score only)' if score_only else ''} | {name} | {run['mode']} "
                f"| {run['learning_rate']:g} | {run['seed']} | "
                + " | ".join(by_step.get(step, "-") for step in eval_steps)
                + f" | {max(accuracies):.1%} | {gap_closed(run):+.0%} | {entropy:.3f} |"
            )
    return "\n".join(lines)


def health(results: list[dict], every: int = 5) -> str:
    """Every ``every``-th step's training metrics of each run: how a run that goes wrong does it."""
    lines = ["\n### Training metrics every few steps\n"]
    for run in sorted(
        results, key=lambda r: (r["task"], r["label"], r["mode"], r["learning_rate"], r["seed"])
    ):
        lines += [
            f"\n{run['task']}, {run['label']}, {run['mode']}, lr {run['learning_rate']:g}, seed "
            f"{run['seed']}\n",
            "| step | teacher KL | per completion | entropy | grad norm | advantage mean | std | "
            "min | completion tokens |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        trained = [row for row in run["metrics"] if "entropy" in row]
        for row in trained:
            if row["step"] % every and row is not trained[-1]:
                continue
            per_completion = row.get("teacher_kl", float("nan")) * row.get(
                "completion_len_mean", float("nan")
            )
            cells = [row.get("teacher_kl", float("nan")), per_completion]
            cells += [row.get(key, float("nan")) for key in ("entropy", "grad_norm")]
            cells += [row.get(f"advantage/{key}", float("nan")) for key in ("mean", "std", "min")]
            lines.append(
                f"| {row['step']} | "
                + " | ".join(f"{value:.3g}" for value in cells)
                + f" | {row.get('completion_len_mean', float('nan')):.1f} |"
            )
    return "\n".join(lines)


def per_flop(
    results: list[dict], labels: list[str], task: str, modes: list[str], batch: int = 16
) -> str:
    """Each label's mean curve (share fully right, and partial credit) against training FLOPs,
    counted as the lab counts them (``bench/lab.py``'s ``step_flops``: the update 6N a token, the
    writer's forward 2N, the teacher's scores 2N where the objective reads them; evaluation not
    counted), and each label's share at the smallest final budget among them."""
    import statistics

    import torch
    from lab import step_flops
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from opd.config.parsing import build_objective
    from opd.config.training import TrainingConfig
    from opd.data.render import ChatRenderer

    base = converted_dir()
    with torch.device("meta"):  # the parameter count, without reading the weights
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(base))
    params = sum(p.numel() for p in model.parameters())
    renderer = ChatRenderer(AutoTokenizer.from_pretrained(base))
    source = cache_root() / "data" / f"{task}-train.jsonl"
    prompts = [json.loads(line)["prompt"] for line in source.read_text().splitlines()[:256]]
    prompt_tokens = statistics.mean(
        len(renderer.prompt_ids([{"role": "user", "content": p}])) for p in prompts
    )
    curves = {}
    for label in labels:
        runs = [
            r for r in results if r["task"] == task and r["label"] == label and r["mode"] in modes
        ]
        points = []
        for run in runs:
            recorded = run["config"]["training"]
            training = TrainingConfig(
                data_source=recorded["data_source"],
                objective=build_objective(recorded["objective"], "training.objective"),
                kl_penalty_coef=recorded["kl_penalty_coef"],
            )
            config = SimpleNamespace(training=training)
            sizes = {"student": params, "teacher": params}
            step_costs = [
                (
                    row["step"],
                    step_flops(row | {"num_sequences": batch}, config, prompt_tokens, sizes),
                )
                for row in run["metrics"]
                if "completion_len_mean" in row
            ]
            for point in run["curve"]:
                flops = sum(cost for step, cost in step_costs if step < point["step"])
                if run.get("curve_counts") == "score":  # recorded before opd counted fully right
                    points.append((point["step"], flops, None, point["accuracy"]))
                else:
                    points.append((point["step"], flops, point["accuracy"], point.get("score")))
        curves[label] = []
        for step in sorted({p[0] for p in points}):
            at = [p for p in points if p[0] == step]
            means = [
                statistics.mean(values) if None not in (values := [p[i] for p in at]) else None
                for i in (1, 2, 3)
            ]
            curves[label].append((step, *means, len(at)))
    budget = min(curve[-1][1] for curve in curves.values())
    lines = [
        f"\n### {task}: accuracy against training FLOPs (N = {params / 1e6:.1f}M, "
        f"{prompt_tokens:.0f} prompt tokens, {batch} sequences a step)\n",
        "| label | step | seeds | training FLOPs | fully right | partial credit |",
        "|---|---|---|---|---|---|",
    ]
    for label, curve in curves.items():
        for step, flops, accuracy, score, seeds in curve:
            cells = ["-" if v is None else f"{v:.1%}" for v in (accuracy, score)]
            lines.append(f"| {label} | {step} | {seeds} | {flops:.3g} | {' | '.join(cells)} |")
    lines.append(f"\nAt {budget:.3g} FLOPs (the smallest final budget):")
    for label, curve in curves.items():
        for before, after in itertools.pairwise(curve):
            if before[1] <= budget <= after[1]:
                share = (budget - before[1]) / max(after[1] - before[1], 1e-30)
                at = [
                    "-"
                    if before[i] is None
                    else f"{before[i] + share * (after[i] - before[i]):.1%}"
                    for i in (2, 3)
                ]
                lines.append(f"- {label}: {at[0]} fully right, partial credit {at[1]}")
    return "\n".join(lines)


def main() -> None:
    tasks = yaml.safe_load(SWEEP.read_text())["tasks"]
    commit = git_commit(ROOT)  # the code this process runs: read before it changes on disk
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tasks", nargs="*", default=["short", "products"], choices=list(tasks))
    parser.add_argument("--modes", nargs="*", default=["lora", "full"], choices=["lora", "full"])
    parser.add_argument(
        "--lrs",
        nargs="*",
        type=float,
        default=[None],
        help="learning rates (default: opd's default per mode)",
    )
    parser.add_argument("--seeds", type=int, nargs="*", default=[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--eval-every", type=int, default=20)
    parser.add_argument(
        "--sft-steps",
        type=int,
        default=0,
        help="first train this many steps on the teacher's samples (NLL, same mode and rate), then"
        " --steps on-policy from the merged result: the published pipeline",
    )
    parser.add_argument(
        "--set", nargs="*", default=[], help="overrides of the variant (after the mode's)"
    )
    parser.add_argument(
        "--then-set",
        nargs="*",
        default=[],
        help="with --sft-steps: overrides of the on-policy stage only (a lower rate after the "
        "switch)",
    )
    parser.add_argument("--label", default="defaults", help="names the variant in the tables")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "defaults")
    parser.add_argument("--report-only", action="store_true")
    parser.add_argument(
        "--per-flop",
        nargs="+",
        metavar="LABEL",
        help="with --report-only, one task and --modes: these labels' mean curves against training"
        " FLOPs",
    )
    parser.add_argument(
        "--stopped",
        type=Path,
        help="the run directory of a run stopped before its last step (for time): its result from"
        " the metrics it logged, marked with the step it reached (one task, mode, rate and seed)",
    )
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.report_only:
        from opd.config import config_from_dict

        base = converted_dir()
        for task in args.tasks:
            spec = tasks[task]
            build = SimpleNamespace(seed=0, eval_every=10, steps=40)
            teacher, teacher_accuracy = prepare_teacher(task, spec, base, build)
            teacher_score = json.loads((teacher / "teacher.json").read_text()).get("score")
            for mode in args.modes:
                for lr in args.lrs:
                    for seed in args.seeds:
                        args.seed = seed
                        overrides = (["student.lora_rank=0"] if mode == "full" else []) + (
                            [f"training.learning_rate={lr}"] if lr is not None else []
                        )
                        overrides += args.set
                        data = user_config(
                            Path("unused"), base, teacher, task, spec, args.steps, args
                        )
                        resolved_lr = config_from_dict(data, overrides).training.learning_rate
                        steps = args.sft_steps + args.steps
                        name = (
                            f"{task}-{args.label}-{mode}-lr{resolved_lr:g}-seed{seed}-{steps}steps"
                        )
                        started = time.perf_counter()
                        if args.stopped:
                            run = stopped_run(args.stopped, task)
                            name += f"-stopped-at-{run['stopped_at_step']}"
                        result_file = args.out / f"{name}.json"
                        if result_file.exists():
                            continue
                        if not args.stopped:
                            run = run_one(name, task, spec, base, teacher, overrides, args)
                        result = {
                            "bench": "bench/defaults_sweep.py",
                            "command": " ".join([Path(sys.executable).name, *sys.argv]),
                            "commit": commit,
                            "environment": environment(),
                            "task": task,
                            "task_spec": spec,
                            "label": args.label,
                            "mode": mode,
                            "learning_rate": resolved_lr,
                            "overrides": overrides,
                            "seed": seed,
                            "steps": steps,
                            "sft_steps": args.sft_steps,
                            "then_overrides": args.then_set,
                            "teacher": str(teacher),
                            "teacher_accuracy": teacher_accuracy,
                            "teacher_score": teacher_score,
                            "config": run["config"],
                            **({"sft_config": run["sft_config"]} if "sft_config" in run else {}),
                            **{k: run[k] for k in ("resumed_from_step",) if k in run},
                            "curve": run["curve"],
                            "metrics": run["steps"],
                            "wall_seconds": time.perf_counter() - started,
                        }
                        if args.stopped:
                            ran = [a for a in sys.argv if a not in ("--stopped", str(args.stopped))]
                            result["command"] = " ".join([Path(sys.executable).name, *ran])
                            result["collected_by"] = " ".join(
                                [Path(sys.executable).name, *sys.argv]
                            )
                            result["stopped_at_step"] = run["stopped_at_step"]
                            result["wall_seconds"] = run["wall_seconds"]
                        result_file.write_text(relative_paths(json.dumps(result, indent=1)) + "\n")
                        print(json.dumps({"run": name, "curve": run["curve"]}), flush=True)
    results = [json.loads(p.read_text()) for p in sorted(args.out.glob("*.json"))]
    ours = [r for r in results if r.get("bench") == "bench/defaults_sweep.py"]
    if args.per_flop:
        table = per_flop(ours, args.per_flop, args.tasks[0], args.modes)
        (args.out / f"per_flop_{args.tasks[0]}.md").write_text(table + "\n")
        print(table)
        return
    tables = report(ours) + "\n" + health(ours)
    (args.out / "defaults.md").write_text(tables + "\n")
    print(tables)


if __name__ == "__main__":
    main()
