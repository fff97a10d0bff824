"""The fast lab: which lever makes a student reach its teacher, on tasks a CPU learns in minutes.

Two generated tasks with multi-step structure, on the demo's character tokenizer:
``carry`` (add two 3-digit numbers, the answer only: the carries are the steps) and ``chain``
(four one-digit terms, worked: each running total written, ``8,10,17``, graded by the last
number). For each, a teacher (2 layers, width 128) is trained on the right answers until it is
nearly perfect, and a student of the same shape is warmed up on them until a fifth of a dev set
is right; both are cached in ``$OPD_CACHE/lab-v2``. Then every method trains the same student
with opd's own trainer, and its greedy accuracy on 128 held-out prompts is measured every
``--eval-every`` steps:

- ``opd-topk``: on-policy, top-k forward KL at the student's samples (opd's default objective)
- ``opd-rkl``: on-policy, the sampled-token reverse KL as the advantage (the reference recipe)
- ``sft-teacher``: SFT on the teacher's samples (sequence-level KD)
- ``sft-truth``: SFT on the ground-truth answers
- ``rl``: the task's reward alone (policy gradient, rewards centred in the group)
- ``rl+kl``: the reward beside the reverse KL
- ``defaults``: nothing set but the models, the data and ``max_steps`` (what a new user runs)

All but ``defaults`` share one setting (full fine-tuning, learning rate 5e-4, 8 prompts x 4
samples); ``--variant NAME:key=value,...`` adds a method (dotted overrides on that base), so a
lever is one variant; ``lab.sampler_noise=SIGMA`` in a variant makes its sampler report each
token's log-prob off by Gaussian noise of SIGMA nats (a sampler and trainer that disagree).
Training FLOPs count each phase a method pays for: sampling 2N per token
(N the sampling model's parameters, prompt included), the teacher's scoring 2N_teacher per token
where its scores are used, the update 6N per token; evaluation is not counted.

    python bench/lab.py --tiny --out /tmp/lab-tiny.json          # the CI smoke run, < 3 minutes
    python bench/lab.py --seeds 0 1 2 3 4 --steps 200 --out docs/results/lab/methods.json
    R=training.objective=sampled_reverse_kl,training.learning_rate=3e-5
    python bench/lab.py --tasks chain --steps 200 --eval-every 25 --methods --variant matched:$R \\
        --variant noise2:$R,lab.sampler_noise=2 \\
        --variant "noise2-truncate:$R,lab.sampler_noise=2,training.rollout_correction={mode:
        truncate}" \\ --out docs/results/lab/rollout-correction-chain.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from provenance import git_commit, write_result

from opd.config import config_from_dict, recorded_config
from opd.data.graders import exact_match, last_number_match
from opd.data.prompts import Prompt
from opd.data.render import ChatRenderer
from opd.demo.char_tokenizer import build_char_tokenizer
from opd.demo.run import DemoModelSpec, build_model
from opd.models import load_causal_lm
from opd.runs.evaluation import accuracy
from opd.sampling.hf_generate import HFGenerateSampler
from opd.trainer.loop import Trainer
from opd.trainer.sft import supervised_finetune

LAB_VERSION = "v2"


@dataclass(frozen=True)
class LabTask:
    """A generated task: (question, worked completion, answer), how it is graded, its length, and
    how its teacher is built (the sudden climb of small-model SFT lands at a step that moves with
    the schedule: each task's was measured to reach its target)."""

    make: object
    grader: str
    max_tokens: int
    teacher: DemoModelSpec
    student_seed: int = 1
    """The student's seed: another init, or the teacher's own (0), its run then stopped early."""


def _carry(rng: random.Random) -> tuple[str, str, str]:
    a, b = rng.randint(100, 999), rng.randint(100, 999)
    answer = str(a + b)[::-1]  # least significant digit first: each digit follows from its carry
    return f"add {a}+{b}", answer, answer


def _chain(rng: random.Random) -> tuple[str, str, str]:
    terms = [rng.randint(1, 9) for _ in range(4)]
    totals = [sum(terms[: i + 1]) for i in range(1, len(terms))]
    return "sum " + "+".join(map(str, terms)), " ".join(map(str, totals)), str(totals[-1])


def teacher_spec(steps: int, target: float) -> DemoModelSpec:
    return DemoModelSpec(
        hidden_size=128,
        num_layers=2,
        sft_steps=steps,
        sft_learning_rate=1e-3,
        target_accuracy=target,
    )


TASKS = {
    "carry": LabTask(_carry, "exact_match", 6, teacher_spec(800, 0.9), student_seed=0),
    "chain": LabTask(_chain, "last_number", 12, teacher_spec(1000, 0.97)),
}
GRADERS = {"exact_match": exact_match, "last_number": last_number_match}
STUDENT = DemoModelSpec(
    hidden_size=128, num_layers=2, sft_steps=1500, sft_learning_rate=1e-3, target_accuracy=0.2
)
"""The teacher's architecture from another seed, its warm-up stopped early: as with a real pair
(the teacher the student fine-tuned), what it lacks is training, not room to learn the task. A
task whose ``student_seed`` is 0 takes the teacher's own run instead, stopped at the same 20%
(``carry``: another seed's warm-up had not begun its climb after 1,500 steps)."""
CHECK_EVERY = 50
"""Supervised steps between two dev checks while a model is built."""
BASE = [
    "student.lora_rank=0",
    "training.learning_rate=5e-4",
    "datasets.0.groups_per_batch=8",
    "datasets.0.group_size=4",
]
"""The lab's shared setting (opd's dotted overrides), which every method but ``defaults`` starts
from."""
METHODS: dict[str, list[str]] = {
    "opd-topk": [*BASE, "training.objective=topk_forward_kl"],
    "opd-rkl": [*BASE, "training.objective=sampled_reverse_kl"],
    "sft-teacher": [*BASE, "training.objective=nll", "training.data_source=teacher"],
    "sft-truth": [*BASE, "training.objective=nll", "training.data_source=dataset"],
    "rl": [
        *BASE,
        "training.objective=sampled_reverse_kl",
        "training.kl_penalty_coef=0",
        "training.reward_coef=1",
    ],
    "rl+kl": [*BASE, "training.objective=sampled_reverse_kl", "training.reward_coef=1"],
    "defaults": [],
}


TINY = False
"""``--tiny``: the smoke run's models, a teacher stopped at half right (the plumbing is what it
checks), built in seconds and cached apart from the lab's own."""


def cache_root() -> Path:
    import os

    suffix = "-tiny" if TINY else ""
    return (
        Path(os.environ.get("OPD_CACHE", Path.home() / ".cache" / "opd"))
        / f"lab-{LAB_VERSION}{suffix}"
    )


def task_prompts(task: str, split: str, count: int) -> list[Prompt]:
    rng = random.Random(f"lab/{task}/{split}")
    prompts = []
    for _ in range(count):
        question, completion, answer = TASKS[task].make(rng)
        prompts.append(
            Prompt(({"role": "user", "content": question},), answer=answer, completion=completion)
        )
    return prompts


def write_jsonl(path: Path, prompts: list[Prompt]) -> None:
    rows = [
        {"prompt": p.messages[0]["content"], "answer": p.answer, "completion": p.completion}
        for p in prompts
    ]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def ensure_task(task: str) -> dict[str, Path]:
    """The task's prompt files and its teacher and student, built once and cached."""
    root = cache_root() / task
    root.mkdir(parents=True, exist_ok=True)
    files = {"train": root / "train.jsonl", "test": root / "test.jsonl"}
    if not files["train"].exists():
        write_jsonl(files["train"], task_prompts(task, "train", 4000))
        write_jsonl(files["test"], task_prompts(task, "test", 256))
    tokenizer = build_char_tokenizer()
    renderer = ChatRenderer(tokenizer)
    grader = GRADERS[TASKS[task].grader]
    dev = task_prompts(task, "dev", 200)
    models = {}
    student = (
        STUDENT if TASKS[task].student_seed else replace(TASKS[task].teacher, target_accuracy=0.2)
    )
    for name, spec, seed in (
        ("teacher", TASKS[task].teacher, 0),
        ("student", student, TASKS[task].student_seed),
    ):
        directory = root / name
        models[name] = directory
        if (directory / "config.json").exists():
            continue
        started = time.perf_counter()
        model = build_model(spec, tokenizer, seed)
        sampler = HFGenerateSampler(model, tokenizer, stop_token_ids=renderer.stop_token_ids)
        reached: list[float] = []

        def should_stop(steps: int, sampler=sampler, spec=spec, reached=reached) -> bool:
            if steps % CHECK_EVERY:
                return False
            reached.append(
                accuracy(sampler, renderer, dev, grader, max_tokens=TASKS[task].max_tokens)
            )
            return reached[-1] >= spec.target_accuracy

        train_prompts = task_prompts(task, "train", 4000)
        supervised_finetune(
            model,
            renderer,
            train_prompts,
            steps=spec.sft_steps,
            batch_size=64,
            learning_rate=spec.sft_learning_rate,
            seed=seed,
            should_stop=should_stop,
        )
        if name == "teacher" and reached[-1] < spec.target_accuracy:
            raise SystemExit(
                f"lab: the {task} teacher reached {reached[-1]:.1%} dev accuracy, short of its "
                f"{spec.target_accuracy:.0%}: another CPU or torch build rounds its training "
                "elsewhere; give the task's teacher more steps (TASKS in bench/lab.py)"
            )
        staging = directory.with_name(name + ".tmp")
        model.save_pretrained(staging, safe_serialization=True)
        tokenizer.save_pretrained(staging)
        staging.replace(directory)
        print(
            f"lab: {task} {name}: dev accuracy {reached[-1]:.1%} after "
            f"{CHECK_EVERY * len(reached)} supervised steps, {time.perf_counter() - started:.0f}s",
            file=sys.stderr,
        )
    return files | models


def run_config(
    files: dict[str, Path], task: str, seed: int, steps: int, eval_every: int, log_path: Path
) -> dict:
    """What every method's run names before its overrides: models, data, steps, evaluation."""
    return {
        "log_path": str(log_path),
        "seed": seed,
        "student": {"model": str(files["student"]), "device": "cpu"},
        "teacher": {"model": str(files["teacher"]), "device": "cpu"},
        "datasets": [
            {
                "name": task,
                "source": str(files["train"]),
                "eval_source": str(files["test"]),
                "eval_num_prompts": 128,
                "grader": TASKS[task].grader,
            }
        ],
        "training": {"max_steps": steps, "max_tokens": TASKS[task].max_tokens},
        "eval_every": eval_every,
        "save_every": 0,
    }


def step_flops(row: dict, config, prompt_tokens: float, params: dict[str, int]) -> float:
    """The FLOPs a step cost, from its metrics and what its method pays for (module docstring)."""
    training = config.training
    tokens = row["num_sequences"] * (prompt_tokens + row["completion_len_mean"])
    if row.get("on_policy"):
        source = "student"
    else:
        source = "dataset" if training.data_source == "dataset" else "teacher"
    flops = 6 * params["student"] * tokens
    if source != "dataset":  # the writer's forward passes, prompt and completion
        flops += 2 * params[source] * tokens
    objective = training.objective_for(source).name
    if objective != "nll" and not (
        objective == "sampled_reverse_kl" and training.kl_penalty_coef == 0
    ):
        flops += 2 * params["teacher"] * tokens  # the teacher's scores are used
    return flops


SAMPLER_NOISE = "lab.sampler_noise="
"""A variant's pseudo-override: the sampler's reported log-probs off by Gaussian noise of this many
nats (the trainer's stay exact), a sampler and trainer that disagree as vLLM in bfloat16 and a
float32 trainer do, made large enough to see."""


def mismatched(trainer: Trainer, sigma: float, seed: int) -> None:
    """Make ``trainer``'s sampler disagree with it: noise on each sampled token's reported
    log-prob."""
    collect, generator = trainer.collect, torch.Generator().manual_seed(seed)

    def noisy(step):
        batch = collect(step)
        logprobs_BT = batch.rollouts.sampled_logprobs_BT
        noise_BT = torch.randn(logprobs_BT.shape, generator=generator) * sigma
        logprobs_BT += noise_BT * batch.rollouts.mask_BT
        return batch

    trainer.collect = noisy


def run_method(files, task, name, overrides, seed, steps, eval_every, scratch: Path) -> dict:
    log_path = scratch / f"{task}-{name}-{seed}"
    noise = [float(o.removeprefix(SAMPLER_NOISE)) for o in overrides if o.startswith(SAMPLER_NOISE)]
    settings = [o for o in overrides if not o.startswith(SAMPLER_NOISE)]
    config = config_from_dict(run_config(files, task, seed, steps, eval_every, log_path), settings)
    started = time.perf_counter()
    trainer = Trainer(config, progress=False)
    if noise:
        mismatched(trainer, noise[0], seed)
    result = trainer.run()
    seconds = time.perf_counter() - started
    rows = [json.loads(line) for line in (log_path / "metrics.jsonl").read_text().splitlines()]
    tokenizer = build_char_tokenizer()
    renderer = ChatRenderer(tokenizer)
    prompts = task_prompts(task, "train", 64)
    prompt_tokens = statistics.mean(len(renderer.prompt_ids(p.messages)) for p in prompts)
    params = {
        role: sum(
            p.numel()
            for p in load_causal_lm(
                str(files[role]), role, dtype="float32", device="cpu"
            ).parameters()
        )
        for role in ("student", "teacher")
    }
    flops, elapsed, curve, kept = 0.0, 0.0, [], []
    key = f"test/{task}/accuracy"
    for row in rows:
        if key in row:
            curve.append(
                {
                    "step": row["step"],
                    "accuracy": row[key],
                    "flops": flops,
                    "seconds": elapsed,
                    "score": row.get(f"test/{task}/score"),
                    "pass@1": row.get(f"test/{task}/pass@1"),
                    "teacher_kl": row.get(f"test/{task}/teacher_kl"),
                }
            )
        if "loss" in row:
            flops += step_flops(row, config, prompt_tokens, params)
            elapsed += row.get("time/total", 0.0)
            kept.append({k: row[k] for k in KEPT if k in row} | {"step": row["step"]})
    del result
    shutil.rmtree(log_path, ignore_errors=True)
    resolved = recorded_config(config)
    for section in ("student", "teacher"):  # paths relative to $OPD_CACHE, not this machine's
        resolved[section]["model"] = str(
            Path(resolved[section]["model"]).relative_to(cache_root().parent)
        )
    resolved["log_path"] = Path(resolved["log_path"]).name
    for key in ("source", "eval_source"):
        resolved["datasets"][0][key] = str(
            Path(resolved["datasets"][0][key]).relative_to(cache_root().parent)
        )
    return {
        "task": task,
        "method": name,
        "seed": seed,
        "overrides": overrides,
        "config": resolved,
        "curve": curve,
        "steps": kept,
        "prompt_tokens": prompt_tokens,
        "parameters": params,
        "wall_seconds": seconds,
    }


KEPT = (
    "teacher_kl",
    "entropy",
    "group/distinct",
    "reward/mean",
    "reward/constant_groups",
    "teacher_kl/answer",
    "teacher_kl/reasoning",
    "diag/first_wrong_teacher_prob",
    "grad_norm",
    "completion_len_mean",
    "num_sequences",
    "on_policy",
)


def teacher_accuracy(files, task: str) -> float:
    tokenizer = build_char_tokenizer()
    renderer = ChatRenderer(tokenizer)
    model = load_causal_lm(str(files["teacher"]), "teacher", dtype="float32", device="cpu")
    sampler = HFGenerateSampler(model, tokenizer, stop_token_ids=renderer.stop_token_ids)
    test = task_prompts(task, "test", 128)
    return accuracy(
        sampler, renderer, test, GRADERS[TASKS[task].grader], max_tokens=TASKS[task].max_tokens
    )


def parse_variant(text: str, base: list[str] = BASE) -> tuple[str, list[str]]:
    """``NAME:key=value,key=value`` (opd's dotted overrides, split at the commas outside braces and
    brackets, so ``training.objective={name: jsd, beta: 0}`` is one) after ``base``: the lab's, or
    none for a variant of opd's defaults."""
    name, _, settings = text.partition(":")
    overrides, depth, current = [], 0, ""
    for character in settings + ",":
        depth += {"{": 1, "[": 1, "}": -1, "]": -1}.get(character, 0)
        if character == "," and depth == 0:
            overrides += [current] if current else []
            current = ""
        else:
            current += character
    return name, [*base, *overrides]


def mean_curve(runs: list[dict], task: str, method: str) -> list[dict]:
    """The method's accuracy and FLOPs at each evaluation, mean (and range) over its seeds."""
    chosen = [run["curve"] for run in runs if run["task"] == task and run["method"] == method]
    points = []
    for at in zip(*chosen, strict=False):
        accuracies = [point["accuracy"] for point in at]
        points.append(
            {
                "step": at[0]["step"],
                "accuracy": statistics.mean(accuracies),
                "low": min(accuracies),
                "high": max(accuracies),
                "flops": statistics.mean(point["flops"] for point in at),
                "seconds": statistics.mean(point["seconds"] for point in at),
            }
        )
    return points


def flops_to_reach(curve: list[dict], target: float) -> float | None:
    """The training FLOPs at which the mean curve first reaches ``target`` (linear between two
    evaluations; None when it never does)."""
    for before, after in itertools.pairwise(curve):
        if after["accuracy"] >= target > before["accuracy"]:
            share = (target - before["accuracy"]) / (after["accuracy"] - before["accuracy"])
            return before["flops"] + share * (after["flops"] - before["flops"])
    return curve[0]["flops"] if curve and curve[0]["accuracy"] >= target else None


def accuracy_at(curve: list[dict], flops: float) -> float:
    """The mean curve's accuracy at ``flops`` training FLOPs (linear between two evaluations)."""
    for before, after in itertools.pairwise(curve):
        if before["flops"] <= flops <= after["flops"]:
            share = (flops - before["flops"]) / max(after["flops"] - before["flops"], 1e-30)
            return before["accuracy"] + share * (after["accuracy"] - before["accuracy"])
    return curve[-1]["accuracy"]


def summary(record: dict) -> str:
    """A markdown table a task: each method's mean accuracy at its evaluations, its range at the
    end, the share of the student's gap to the teacher closed, and the FLOPs to 60% of the
    teacher."""
    runs, lines = record["results"], []
    for task, teacher in record["teacher_accuracy"].items():
        methods = list(dict.fromkeys(run["method"] for run in runs if run["task"] == task))
        curves = {method: mean_curve(runs, task, method) for method in methods}
        steps = [point["step"] for point in next(iter(curves.values()))]
        budget = min(
            curve[-1]["flops"] for curve in curves.values()
        )  # every method's accuracy there
        seeds = len({run["seed"] for run in runs if run["task"] == task})
        lines += [
            f"**{task}** (teacher {teacher:.1%}; mean of {seeds} seeds; greedy accuracy, share "
            "fully right)",
            "",
            "| method | " + " | ".join(f"step {s}" for s in steps) + " | end range | gap closed "
            f"| FLOPs to 60% of the teacher | accuracy at {budget:.3g} FLOPs |",
            "|---" * (len(steps) + 5) + "|",
        ]
        for method, curve in curves.items():
            start, end = curve[0]["accuracy"], curve[-1]["accuracy"]
            closed = (end - start) / (teacher - start) if teacher > start else float("nan")
            reach = flops_to_reach(curve, 0.6 * teacher)
            lines.append(
                f"| {method} | "
                + " | ".join(f"{point['accuracy']:.1%}" for point in curve)
                + f" | {curve[-1]['low']:.1%}-{curve[-1]['high']:.1%} | {closed:.0%} | "
                + (f"{reach:.3g}" if reach is not None else "not reached")
                + f" | {accuracy_at(curve, budget):.1%} |"
            )
        lines.append("")
    return "\n".join(lines)


def figure(record: dict, path: Path) -> None:
    """Accuracy against steps and against training FLOPs, a row a task, a line a method (its
    seeds' mean, their range shaded), the teacher dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs, tasks = record["results"], list(record["teacher_accuracy"])
    fig, axes = plt.subplots(len(tasks), 2, figsize=(11, 3.6 * len(tasks)), dpi=110, squeeze=False)
    for row, task in enumerate(tasks):
        methods = list(dict.fromkeys(run["method"] for run in runs if run["task"] == task))
        for column, x in enumerate(("step", "flops")):
            ax = axes[row][column]
            for method in methods:
                curve = mean_curve(runs, task, method)
                xs = [point[x] for point in curve]
                ax.plot(xs, [point["accuracy"] for point in curve], label=method)
                ax.fill_between(
                    xs, [p["low"] for p in curve], [p["high"] for p in curve], alpha=0.12
                )
            ax.axhline(
                record["teacher_accuracy"][task], color="black", linestyle="--", label="teacher"
            )
            ax.set_xlabel("training step" if x == "step" else "training FLOPs")
            if x == "flops":
                ax.set_xscale("log")
            ax.set_ylabel("held-out accuracy")
            ax.set_title(f"{task}: accuracy against {'steps' if x == 'step' else 'FLOPs'}")
            ax.grid(alpha=0.3)
        axes[row][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def combined(paths: list[Path], only: list[str] | None) -> dict:
    """The runs of several result files as one record (``only``: these methods, in this order)."""
    records = [json.loads(path.read_text()) for path in paths]
    runs = [run for record in records for run in record["results"]]
    if only:
        runs = sorted(
            (run for run in runs if run["method"] in only),
            key=lambda run: only.index(run["method"]),
        )
    teachers = {task: acc for record in records for task, acc in record["teacher_accuracy"].items()}
    return {"results": runs, "teacher_accuracy": teachers}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
    parser.add_argument("--methods", nargs="*", default=list(METHODS), choices=list(METHODS))
    parser.add_argument(
        "--variant", action="append", default=[], help="NAME:key=value,... on the base"
    )
    parser.add_argument(
        "--defaults-variant",
        action="append",
        default=[],
        help="NAME:key=value,... on opd's defaults",
    )
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2, 3, 4])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--eval-every", type=int, default=20)
    parser.add_argument(
        "--tiny",
        action="store_true",
        help="one task, one seed, 6 steps, a half-right teacher: the smoke run",
    )
    parser.add_argument("--out", type=Path, required=True, help="the result file (JSON)")
    parser.add_argument("--report-only", action="store_true", help="the table and figure of --out")
    parser.add_argument(
        "--combine",
        type=Path,
        nargs="+",
        help="with --report-only: these result files' runs together",
    )
    parser.add_argument(
        "--only", nargs="+", help="with --report-only: these methods, in this order"
    )
    args = parser.parse_args(argv)
    if args.report_only:
        record = (
            combined(args.combine, args.only) if args.combine else json.loads(args.out.read_text())
        )
        figure(record, args.out.with_suffix(".png"))
        print(summary(record))
        return 0
    if args.tiny:
        global TINY
        TINY = True
        args.tasks, args.seeds, args.steps, args.eval_every = ["chain"], [0], 6, 3
        TASKS["chain"] = replace(
            TASKS["chain"], teacher=replace(TASKS["chain"].teacher, target_accuracy=0.5)
        )
    methods = {name: METHODS[name] for name in args.methods} | dict(
        map(parse_variant, args.variant)
    )
    methods |= dict(parse_variant(text, []) for text in args.defaults_variant)
    runs, teachers, commit = [], {}, git_commit(Path(__file__).resolve().parents[1])
    settings = {
        "tasks": args.tasks,
        "methods": methods,
        "seeds": args.seeds,
        "steps": args.steps,
        "eval_every": args.eval_every,
        "base": BASE,
        "teachers": {t: vars_of(TASKS[t].teacher) for t in args.tasks},
        "student": vars_of(STUDENT),
    }
    with tempfile.TemporaryDirectory(prefix="opd-lab-") as scratch:
        for task in args.tasks:
            files = ensure_task(task)
            teachers[task] = teacher_accuracy(files, task)
            for seed in args.seeds:
                for name, method in methods.items():
                    run = run_method(
                        files, task, name, method, seed, args.steps, args.eval_every, Path(scratch)
                    )
                    runs.append(run)
                    end = run["curve"][-1]
                    print(
                        f"lab: {task} {name} seed {seed}: {run['curve'][0]['accuracy']:.1%} -> "
                        f"{end['accuracy']:.1%} ({end['flops']:.3g} FLOPs, "
                        f"{run['wall_seconds']:.0f}s)",
                        file=sys.stderr,
                    )
                    # the file so far after every run: a long lab can be read while it runs
                    write_result(
                        args.out, "lab", settings, runs, teacher_accuracy=teachers, commit=commit
                    )
    record = json.loads(args.out.read_text())
    figure(record, args.out.with_suffix(".png"))
    print(summary(record))
    return 0


def vars_of(spec: DemoModelSpec) -> dict:
    return {
        "hidden_size": spec.hidden_size,
        "num_layers": spec.num_layers,
        "sft_learning_rate": spec.sft_learning_rate,
        "target_accuracy": spec.target_accuracy,
    }


if __name__ == "__main__":
    sys.exit(main())
