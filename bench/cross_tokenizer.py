"""Does a teacher with another tokenizer teach as well as one with the student's own?

The demo's task, student and training (`opd demo`: character-level tokenizer, 2 layers, width
96, about 50% held out) learn from two teachers built by the same recipe and seed (2 layers,
width 128, supervised on the task until nearly perfect) that differ only in their tokenizer:
the demo's own character-level one, and a BPE tokenizer learned on the task's text (most
answer tokens two or three letters). With the BPE teacher the run sets
``teacher.cross_tokenizer: true``, so every completion is re-tokenized for the teacher and
each teacher token's log-prob split over its letters (docs/teachers.md). Held-out greedy
accuracy before and after is measured as the demo measures it, per seed; the figure is the
BPE teacher's gain over the character teacher's.

    python bench/cross_tokenizer.py --seeds 0 1 2 --steps 200 --out
    docs/results/cross_tokenizer.json python bench/cross_tokenizer.py --bpe-steps 10000 --set
    teacher.character_topk=0   # a longer-trained
                                                                     # teacher; the even split
    python bench/cross_tokenizer.py --char-target 0.92   # also a character teacher stopped at 92%
    on
                                                         # dev: the same tokenizer, the BPE one's
                                                         accuracy

The BPE teacher stays below the character one (about 92% against 100% held out), so the ratio
of their gains mixes the tokenizer with the teacher's accuracy; ``--char-target`` adds a third
teacher, the character one with its supervised training stopped once its dev accuracy reaches
the target, to compare the BPE teacher with a same-tokenizer teacher that knows as much.
"""

from __future__ import annotations

import argparse
import os
import shutil
import string
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch
from provenance import write_result
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from opd.config import apply_overrides, config_from_dict
from opd.data.builtin_tasks import generate_task_prompts
from opd.data.graders import exact_match
from opd.data.render import ChatRenderer
from opd.demo import run as demo
from opd.demo.char_tokenizer import SPECIAL_TOKENS, with_chat_specials
from opd.models import load_causal_lm
from opd.runs.evaluation import accuracy
from opd.sampling.hf_generate import HFGenerateSampler
from opd.teachers.local import LocalTeacher
from opd.trainer.loop import train
from opd.trainer.sft import supervised_finetune

BPE_VOCAB = 160
"""The printable characters, the specials and about 60 merges: answers average 1.5 letters a
token (300 gives 1.9, and a teacher of this size stalls near 50% on the task with it)."""
BPE_CHECK_EVERY = 200
BPE_TARGET = 0.98


def build_bpe_tokenizer() -> PreTrainedTokenizerFast:
    """A BPE tokenizer learned on the task's prompts and answers, with the demo's specials and
    template.

    Every printable character is in its alphabet, so no text is dropped; words are split at
    whitespace before merging, so tokens never straddle a space.
    """
    texts = []
    for prompt in generate_task_prompts(demo.TASK, seed=0, count=4000):
        texts += [prompt.messages[0]["content"], prompt.answer, "user", "assistant"]
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"\s+|\S+"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=list(string.printable),
    )
    backend.train_from_iterator(texts, trainer)
    return with_chat_specials(backend)


def build_bpe_teacher(directory: Path, max_steps: int) -> Path:
    """The demo teacher's size, seed, prompts and learning rate with the BPE tokenizer, trained
    until it is as good as the character-level one on a dev split (reversing words whose letters
    are hidden inside multi-letter tokens takes it far longer)."""
    if (directory / "config.json").exists():
        return directory
    tokenizer = build_bpe_tokenizer()
    renderer = ChatRenderer(tokenizer)
    spec = demo.TEACHER_SPEC
    model = demo.build_model(spec, tokenizer, seed=0)
    sampler = HFGenerateSampler(model, tokenizer, stop_token_ids=renderer.stop_token_ids)
    dev_prompts = generate_task_prompts(demo.TASK, seed=2000, count=demo.NUM_DEV_PROMPTS)

    def good_enough(steps_done: int) -> bool:
        if steps_done % BPE_CHECK_EVERY:
            return False
        dev = accuracy(sampler, renderer, dev_prompts, exact_match, max_tokens=demo.MAX_TOKENS)
        print(f"  BPE teacher: {dev:.1%} on the dev split after {steps_done} steps", flush=True)
        return dev >= BPE_TARGET

    steps = supervised_finetune(
        model,
        renderer,
        generate_task_prompts(demo.TASK, seed=1000),
        steps=max_steps,
        batch_size=64,
        learning_rate=spec.sft_learning_rate,
        seed=0,
        should_stop=good_enough,
    )
    print(f"  BPE teacher: {len(steps)} supervised steps", flush=True)
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)
    return directory


def teacher_accuracy(directory: Path, eval_prompts) -> float:
    """Greedy held-out accuracy of a teacher with its own tokenizer."""
    tokenizer = PreTrainedTokenizerFast.from_pretrained(directory)
    renderer = ChatRenderer(tokenizer)
    model = load_causal_lm(str(directory), "teacher.model", dtype="float32", device="cpu")
    sampler = HFGenerateSampler(model, tokenizer, stop_token_ids=renderer.stop_token_ids)
    return accuracy(sampler, renderer, eval_prompts, exact_match, max_tokens=demo.MAX_TOKENS)


def answer_tokens_per_char(directory: Path, eval_prompts) -> float:
    """Mean characters per token of the held-out answers under a teacher's tokenizer."""
    tokenizer = PreTrainedTokenizerFast.from_pretrained(directory)
    chars = sum(len(p.answer) for p in eval_prompts)
    tokens = sum(
        len(tokenizer(p.answer, add_special_tokens=False)["input_ids"]) for p in eval_prompts
    )
    return chars / tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument(
        "--bpe-steps",
        type=int,
        default=3000,
        help="most supervised steps of the BPE teacher (it stops at 98%% on dev)",
    )
    parser.add_argument(
        "--char-target",
        type=float,
        default=None,
        help="also a character teacher whose supervised training stops at this dev accuracy",
    )
    parser.add_argument(
        "--teachers",
        nargs="+",
        default=["char", "bpe", "char-matched"],
        choices=["char", "bpe", "char-matched"],
        help="which teachers' runs to make (char-matched only with --char-target)",
    )
    parser.add_argument("--set", nargs="*", default=[], metavar="DOTTED.KEY=VALUE")
    parser.add_argument(
        "--work-dir", default=None, help="models and runs (default: a new temp dir)"
    )
    parser.add_argument(
        "--out", type=Path, help="also write the results here as JSON, with their provenance"
    )
    args = parser.parse_args()
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="opd-cross-tokenizer-"))
    os.environ["OPD_CACHE"] = str(work / "cache")
    torch.set_num_threads(1)
    char_teacher = demo.ensure_model("teacher", demo.TEACHER_SPEC, seed=0, log=print)
    student = demo.ensure_model("student", demo.STUDENT_SPEC, seed=1, log=print)
    bpe_teacher = build_bpe_teacher(work / f"bpe-teacher-{args.bpe_steps}", args.bpe_steps)
    eval_prompts = generate_task_prompts(f"{demo.TASK}@test", seed=0, count=demo.NUM_EVAL_PROMPTS)
    teachers = {
        "char": {"path": char_teacher, "overrides": []},
        "bpe": {"path": bpe_teacher, "overrides": ["teacher.cross_tokenizer=true"]},
    }
    if args.char_target is not None and "char-matched" in args.teachers:
        spec = replace(demo.TEACHER_SPEC, target_accuracy=args.char_target)
        name = f"teacher-dev{args.char_target:g}"
        teachers["char-matched"] = {
            "path": demo.ensure_model(name, spec, seed=0, log=print),
            "overrides": [],
        }
    teachers = {name: teacher for name, teacher in teachers.items() if name in args.teachers}
    for name, teacher in teachers.items():
        teacher["accuracy"] = teacher_accuracy(teacher["path"], eval_prompts)
        teacher["chars_per_answer_token"] = answer_tokens_per_char(teacher["path"], eval_prompts)
        print(
            f"{name} teacher: {teacher['accuracy']:.1%}, {teacher['chars_per_answer_token']:.2f} "
            "chars/token"
        )
    char_scorer = LocalTeacher(
        load_causal_lm(str(char_teacher), "teacher.model", dtype="float32", device="cpu"),
        vocab_size=len(demo.build_char_tokenizer()),
        pad_id=0,
    )
    student_model = load_causal_lm(str(student), "student.model", dtype="float32", device="cpu")
    before = demo.measure(student_model, char_scorer, eval_prompts, seed=0)
    rows = []
    for seed in args.seeds:
        for name, teacher in teachers.items():
            run_dir = work / f"run-{name}-seed{seed}"
            shutil.rmtree(run_dir, ignore_errors=True)
            data = demo.demo_config(str(run_dir), student, teacher["path"], args.steps, seed)
            config = config_from_dict(apply_overrides(data, teacher["overrides"] + args.set))
            started = time.perf_counter()
            trained = train(config, progress=False)
            after = demo.measure(trained.student, char_scorer, eval_prompts, seed=0)
            kls = [row["teacher_kl"] for row in trained.metrics if "teacher_kl" in row]
            row = {
                "seed": seed,
                "teacher": name,
                "before": before,
                "after": after,
                "gain": after["accuracy"] - before["accuracy"],
                "train_teacher_kl_first10": sum(kls[:10]) / len(kls[:10]),
                "train_teacher_kl_last10": sum(kls[-10:]) / len(kls[-10:]),
                "seconds": time.perf_counter() - started,
            }
            rows.append(row)
            print(
                f"seed {seed} {name:>4} teacher: accuracy {before['accuracy']:.1%} -> "
                f"{after['accuracy']:.1%} (char-teacher KL {before['teacher_kl']:.3f} -> "
                f"{after['teacher_kl']:.3f}), {row['seconds']:.0f}s",
                flush=True,
            )
    gains = {name: [r["gain"] for r in rows if r["teacher"] == name] for name in teachers}
    mean_gain = {name: sum(values) / len(values) for name, values in gains.items()}
    print("mean gain: " + ", ".join(f"{name} {gain:+.1%}" for name, gain in mean_gain.items()))
    summary = {
        "teachers": {
            n: {k: str(v) if k == "path" else v for k, v in t.items()} for n, t in teachers.items()
        },
        "mean_gain": mean_gain,
    }
    for reference in ("char", "char-matched"):
        if "bpe" in mean_gain and mean_gain.get(reference):
            summary[f"bpe_over_{reference.replace('-', '_')}"] = (
                mean_gain["bpe"] / mean_gain[reference]
            )
            print(f"bpe / {reference} = {mean_gain['bpe'] / mean_gain[reference]:.2f}")
    write_result(
        args.out,
        "bench/cross_tokenizer.py",
        vars(args) | {"work_dir": str(work)},
        rows,
        summary=summary,
    )


if __name__ == "__main__":
    main()
