"""``opd demo``: distil a tiny teacher into a smaller student on a built-in task, on a CPU.

The teacher (2 layers, width 128) is trained on the task until it is nearly perfect; the
student (2 layers, width 96) is given a short supervised warm-up so it knows the answer
format but gets most answers wrong. Both are cached (``$OPD_CACHE`` or ``~/.cache/opd``).
Then on-policy distillation runs with the regular trainer, and the student's held-out
accuracy and teacher KL are printed before and after. docs/demo.md: why the models are
built this way, and how much the result depends on the student.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import LlamaConfig, LlamaForCausalLM

from opd.assemble.eval_sets import direct_scorer
from opd.config import config_from_dict
from opd.data.builtin_tasks import generate_task_prompts
from opd.data.graders import exact_match
from opd.data.render import ChatRenderer
from opd.demo.char_tokenizer import build_char_tokenizer
from opd.models import load_causal_lm
from opd.runs.checkpoints import latest_model_dir
from opd.runs.evaluation import EvalSet, accuracy, evaluate
from opd.sampling.hf_generate import HFGenerateSampler
from opd.teachers.local import LocalTeacher
from opd.trainer.loop import train
from opd.trainer.sft import supervised_finetune

DEMO_VERSION = "v2"
TASK = "reverse"
MAX_TOKENS = 10
NUM_EVAL_PROMPTS = 200


@dataclass(frozen=True)
class DemoModelSpec:
    """How a demo model is built: its size and its supervised training.

    Small-model SFT sits near 0% for a few hundred steps, then climbs to 100% within about a
    hundred, at a step that moves with the seed and with rounding. So the student trains at a
    nearly constant learning rate (``sft_steps`` is only a cap, the decay spans it) and stops at
    the first check where its accuracy on a large dev split reaches ``target_accuracy``: it lands
    near that accuracy whatever step the climb starts at.
    """

    hidden_size: int
    num_layers: int
    sft_steps: int
    sft_learning_rate: float
    target_accuracy: float | None = None


TEACHER_SPEC = DemoModelSpec(hidden_size=128, num_layers=2, sft_steps=300, sft_learning_rate=1e-3)
STUDENT_SPEC = DemoModelSpec(
    hidden_size=96, num_layers=2, sft_steps=1500, sft_learning_rate=3e-3, target_accuracy=0.5
)
CHECK_EVERY = 2
NUM_DEV_PROMPTS = 400
DEFAULT_STEPS = 400
DEFAULT_LEARNING_RATE = 5e-4


BUILD_BAR = "{desc} {n_fmt}/{total_fmt} supervised steps at most [{elapsed}<{remaining}{postfix}]"
"""The bar of a model being built; a student stops early, when it reaches its target."""


def cache_dir() -> Path:
    """Where built demo models live between runs."""
    root = Path(os.environ.get("OPD_CACHE", Path.home() / ".cache" / "opd"))
    return root / f"demo-{DEMO_VERSION}"


def build_model(spec: DemoModelSpec, tokenizer, seed: int) -> LlamaForCausalLM:
    """A randomly initialised Llama of the given size (tied embeddings, small vocabulary)."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=2 * spec.hidden_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=128,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        tie_word_embeddings=True,
    )
    return LlamaForCausalLM(config)


def ensure_model(
    name: str, spec: DemoModelSpec, seed: int, log=print, progress: bool = False
) -> Path:
    """Build, train and save a demo model unless the cache already has it (``progress``: a bar of
    its supervised steps, the minutes a first demo spends here)."""
    directory = cache_dir() / name
    if (directory / "config.json").exists():
        return directory
    tokenizer = build_char_tokenizer()
    renderer = ChatRenderer(tokenizer)
    model = build_model(spec, tokenizer, seed)
    prompts = generate_task_prompts(TASK, seed=seed + 1000)
    started = time.perf_counter()
    log(f"building the demo {name} ({spec.num_layers} layers, width {spec.hidden_size}) ...")
    should_stop = None
    dev_accuracies: list[float] = []
    if spec.target_accuracy is not None:
        dev_prompts = generate_task_prompts(TASK, seed=seed + 2000, count=NUM_DEV_PROMPTS)
        sampler = HFGenerateSampler(model, tokenizer, stop_token_ids=renderer.stop_token_ids)

        def should_stop(steps_done: int) -> bool:
            if steps_done % CHECK_EVERY:
                return False
            dev_accuracies.append(
                accuracy(sampler, renderer, dev_prompts, exact_match, max_tokens=MAX_TOKENS)
            )
            return dev_accuracies[-1] >= spec.target_accuracy

    bar = tqdm(
        total=spec.sft_steps,
        desc=f"  {name}",
        disable=not progress,
        bar_format=BUILD_BAR,
        leave=False,
    )

    def on_step(loss: float) -> None:
        shown = f"loss {loss:.3f}" + (f" dev {dev_accuracies[-1]:.0%}" if dev_accuracies else "")
        bar.set_postfix_str(shown, refresh=False)
        bar.update(1)

    with bar:
        losses = supervised_finetune(
            model,
            renderer,
            prompts,
            steps=spec.sft_steps,
            batch_size=64,
            learning_rate=spec.sft_learning_rate,
            seed=seed,
            should_stop=should_stop,
            on_step=on_step,
        )
    log(f"  {len(losses)} supervised steps in {time.perf_counter() - started:.0f}s")
    if dev_accuracies and dev_accuracies[-1] < spec.target_accuracy:
        log(
            f"  warning: the {name} reached {dev_accuracies[-1]:.0%} dev accuracy, short of the "
            f"{spec.target_accuracy:.0%} it should start from; the demo will show less"
        )
    staging = directory.with_name(directory.name + ".tmp")
    model.save_pretrained(staging, safe_serialization=True)
    tokenizer.save_pretrained(staging)
    staging.replace(directory)
    return directory


def measure(model, teacher: LocalTeacher, eval_prompts, seed: int) -> dict[str, float]:
    """Greedy accuracy and sampled teacher KL of a model on the held-out prompts."""
    tokenizer = build_char_tokenizer()
    renderer = ChatRenderer(tokenizer)
    sampler = HFGenerateSampler(model, tokenizer, stop_token_ids=renderer.stop_token_ids)
    metrics = evaluate(
        sampler,
        renderer,
        [EvalSet(TASK, 0, eval_prompts, exact_match, direct_scorer(teacher))],
        temperature=1.0,
        max_tokens=MAX_TOKENS,
        seed=seed,
        pad_id=tokenizer.pad_token_id,
    )
    return {
        "accuracy": metrics[f"test/{TASK}/accuracy"],
        "teacher_kl": metrics[f"test/{TASK}/teacher_kl"],
    }


def demo_config(
    log_path: str,
    student_dir: Path,
    teacher_dir: Path,
    steps: int,
    seed: int,
    learning_rate: float = DEFAULT_LEARNING_RATE,
) -> dict:
    """The run configuration the demo trains with: what a user would write in YAML."""
    return {
        "log_path": log_path,
        "seed": seed,
        "student": {"model": str(student_dir), "lora_rank": 0, "dtype": "float32", "device": "cpu"},
        "teacher": {"model": str(teacher_dir), "dtype": "float32", "device": "cpu"},
        "datasets": [
            {"name": TASK, "source": f"demo:{TASK}", "groups_per_batch": 16, "group_size": 4}
        ],
        "training": {
            "objective": "sampled_reverse_kl",
            "learning_rate": learning_rate,
            "max_tokens": MAX_TOKENS,
            "temperature": 1.0,
            "kl_penalty_coef": 1.0,
            "loss_fn": "importance_sampling",
            "max_steps": steps,
        },
    }


def gap_summary(teacher: float, before: float, after: float) -> str:
    """How much of the student's accuracy gap to the teacher the run closed ("" without a gap)."""
    gap_before, gap_after = teacher - before, teacher - after
    if gap_before <= 0:
        return ""
    if gap_after > gap_before:
        return (
            f"the student fell {100 * (gap_after - gap_before):.1f} points further behind the "
            "teacher: a short run can end in the dip of its first steps (try more --steps), and a "
            "student that does not learn at this rate may at a lower one (try a lower --lr; "
            "docs/demo.md)"
        )
    return f"the student closed {1 - gap_after / gap_before:.0%} of its accuracy gap to the teacher"


def run_demo(
    log_path: str = "runs/demo",
    steps: int = DEFAULT_STEPS,
    seed: int = 0,
    log=print,
    progress: bool = True,
    learning_rate: float = DEFAULT_LEARNING_RATE,
) -> dict[str, dict[str, float]]:
    """Build (or reuse) the models, distil, and report accuracy and teacher KL before and after."""
    started = time.perf_counter()
    teacher_dir = ensure_model("teacher", TEACHER_SPEC, seed=seed, log=log, progress=progress)
    student_dir = ensure_model("student", STUDENT_SPEC, seed=seed + 1, log=log, progress=progress)
    teacher_model = load_causal_lm(str(teacher_dir), "teacher.model", dtype="float32", device="cpu")
    tokenizer = build_char_tokenizer()
    teacher = LocalTeacher(teacher_model, vocab_size=len(tokenizer), pad_id=tokenizer.pad_token_id)
    eval_prompts = generate_task_prompts(f"{TASK}@test", seed=seed, count=NUM_EVAL_PROMPTS)
    renderer = ChatRenderer(tokenizer)
    teacher_sampler = HFGenerateSampler(
        teacher_model, tokenizer, stop_token_ids=renderer.stop_token_ids
    )
    teacher_accuracy = accuracy(
        teacher_sampler, renderer, eval_prompts, exact_match, max_tokens=MAX_TOKENS
    )
    results = {
        "teacher": {"accuracy": teacher_accuracy, "teacher_kl": 0.0},
        "student before": measure(
            load_causal_lm(str(student_dir), "student.model", dtype="float32", device="cpu"),
            teacher,
            eval_prompts,
            seed,
        ),
    }
    log(
        f"distilling for {steps} steps at lr {learning_rate:g} (task '{TASK}', {NUM_EVAL_PROMPTS} "
        "held-out prompts) ..."
    )
    config = config_from_dict(
        demo_config(log_path, student_dir, teacher_dir, steps, seed, learning_rate)
    )
    trained = train(config, progress=progress)
    results["student after"] = measure(trained.student, teacher, eval_prompts, seed)
    log("")
    log(f"{'':16}{'accuracy':>10}{'teacher KL':>12}")
    for name, row in results.items():
        log(f"{name:16}{row['accuracy']:>10.1%}{row['teacher_kl']:>12.3f}")
    accuracies = (
        results[name]["accuracy"] for name in ("teacher", "student before", "student after")
    )
    summary = gap_summary(*accuracies)
    if summary:
        log(f"\n{summary}")
    log(
        f"(greedy accuracy and sampled teacher KL on {NUM_EVAL_PROMPTS} held-out prompts; the "
        "run's own evaluations in metrics.jsonl and `opd report` use the first 64 of them)"
    )
    log(
        f"metrics: {Path(log_path) / 'metrics.jsonl'}   student: {latest_model_dir(Path(log_path))}"
    )
    log(f"total time {time.perf_counter() - started:.0f}s")
    return results
