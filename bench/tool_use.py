"""Does a student learn to use a tool from a teacher that uses it? Multi-turn distillation in the
``calculator`` environment.

The task is ``demo:arithmetic`` (2-3 numbers of 3-4 digits added and subtracted, answered
exactly). The teacher (2 layers, width 128, the demo's character tokenizer) is trained on its
own episodes: it writes ``<calc>EXPRESSION</calc>``, reads the calculator's result and copies
it. The student (2 layers, width 96) is given the two skills a small pretrained LM would bring
from elsewhere: to repeat an expression it is asked to repeat, and to copy a calculator's result
it is shown after a call (measured before distillation and recorded). It has never written a
call itself, and answers a question directly (wrong: a model this small cannot add 4-digit
numbers). Then the student is distilled
on-policy in the calculator environment (the teacher scores the student's turns only) and its
held-out success rate (greedy episodes, exact answers) is measured before and after, per seed.
The figure: the share of the teacher-student gap closed.

    python bench/tool_use.py --seeds 0 1 2 --steps 200 --out docs/results/tool_use.json
    python bench/tool_use.py --teacher remote --out docs/results/tool_use_remote.json  # through opd
    serve python bench/tool_use.py --teacher bpe --out docs/results/tool_use_bpe.json  # another
    tokenizer

``--teacher remote`` serves the same teacher with ``opd serve`` (loopback) and distils through
it; ``--teacher bpe`` trains a teacher of the same size on a BPE tokenizer learned on the task's
text and distils with ``teacher.cross_tokenizer: true``. Each run uses its teacher's default
objective (opd's unset ``training.objective``), recorded in the result, and starts from the
teacher's episodes (``data_source: mixed``, the student's share going from 0 to 1 over the first
half of the steps), which the served teacher writes on its server and the BPE teacher in its own
tokens (the student learns their text by its likelihood: the unset ``off_policy_objective`` of a
cross-tokenizer teacher is ``nll``).

    python bench/tool_use.py --teacher bpe --set "training.lmbda={start: 0, end: 0.5, steps: 300}"
    python bench/tool_use.py --teacher bpe --set training.data_source=teacher training.objective=nll

``--show-calls N`` records each final student's greedy first turns on N held-out questions and
whether each is the right call. ``--compare-readings N`` (with ``--teacher bpe``) has each final
student sample N held-out calls and answers and reads them with the BPE teacher and with its
character-level twin;
``--compare-answer`` shows where the two part on one answer turn:

    python bench/tool_use.py --compare-answer 8703+8754-5435 12022 12202
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import string
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import tool_use_readings as readings
from local_server import free_port, wait_for_health
from provenance import write_result
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from opd.config import apply_overrides, config_from_dict, config_to_dict
from opd.data.builtin_tasks import generate_task_prompts
from opd.data.prompts import Prompt
from opd.data.render import ChatRenderer
from opd.demo import run as demo
from opd.demo.char_tokenizer import SPECIAL_TOKENS, build_char_tokenizer, with_chat_specials
from opd.envs.calculator import calculate
from opd.trainer.loop import train
from opd.trainer.sft import supervised_finetune

TASK = "demo:arithmetic"
CACHE = Path(os.environ.get("OPD_CACHE", Path.home() / ".cache" / "opd")) / "tool-use-v2"
MAX_TOKENS = 32
"""A turn: the longest call, ``<calc>9999+9999-9999</calc>`` and its end of turn, is 28 tokens."""
MIN_READING = 0.5
"""Below this share of results copied, the student lacks the skill the task assumes it brings."""
TEACHER = demo.DemoModelSpec(hidden_size=128, num_layers=2, sft_steps=1500, sft_learning_rate=1e-3)
STUDENT = demo.DemoModelSpec(hidden_size=96, num_layers=2, sft_steps=1500, sft_learning_rate=3e-3)


def expression(prompt: Prompt) -> str:
    return prompt.messages[0]["content"].removeprefix("compute ")


def reading_turn(prompt: Prompt, shown: str) -> Prompt:
    """After the question's call and the calculator's answer ``shown``, the turn that copies it."""
    history = (
        *prompt.messages,
        {"role": "assistant", "content": f"<calc>{expression(prompt)}</calc>"},
        {"role": "tool", "content": shown},
    )
    return Prompt(history, completion=shown)


def tool_turns(prompts: list[Prompt]) -> list[Prompt]:
    """The teacher's episodes as supervised turns: the call, then the answer after the result."""
    turns = []
    for prompt in prompts:
        turns.append(Prompt(prompt.messages, completion=f"<calc>{expression(prompt)}</calc>"))
        turns.append(reading_turn(prompt, prompt.answer))
    return turns


def student_turns(prompts: list[Prompt]) -> list[Prompt]:
    """The student's supervised turns: repeating an expression, and reading a calculator's result
    after a call (never making one). The result shown is another question's value, so copying it
    is the only rule that fits: with the right value a small student learns to guess the sum
    from the question instead, and reads none (measured: 0 of 40 right results copied)."""
    turns = []
    for index, prompt in enumerate(prompts):
        if index % 2:
            repeat = ({"role": "user", "content": f"repeat {expression(prompt)}"},)
            turns.append(Prompt(repeat, completion=expression(prompt)))
        else:
            turns.append(reading_turn(prompt, prompts[(index + 1) % len(prompts)].answer))
    return turns


def greedy_turns(model, tokenizer, prompts: list[Prompt]) -> list[str]:
    """``model``'s greedy next turn after each prompt's messages, as text."""
    from opd.sampling.hf_generate import HFGenerateSampler

    renderer = ChatRenderer(tokenizer)
    sampler = HFGenerateSampler(model, tokenizer, stop_token_ids=renderer.stop_token_ids)
    completions = sampler.sample(
        [renderer.prompt_ids(prompt.messages) for prompt in prompts],
        temperature=1.0,
        max_tokens=MAX_TOKENS,
        greedy=True,
    )
    return [
        tokenizer.decode(completion.token_ids, skip_special_tokens=True).strip()
        for completion in completions
    ]


def reading_rate(model_dir: Path, prompts: list[Prompt]) -> float:
    """The share of right-call histories (the call, the calculator's right result) after which a
    model's greedy answer is that result: the skill a student must bring."""
    from opd.models import load_causal_lm, load_tokenizer

    tokenizer = load_tokenizer(str(model_dir), "student")
    model = load_causal_lm(str(model_dir), "student", dtype="float32", device="cpu")
    readings = [reading_turn(prompt, prompt.answer) for prompt in prompts]
    answers = greedy_turns(model, tokenizer, readings)
    copied = [
        answer == reading.completion for answer, reading in zip(answers, readings, strict=True)
    ]
    return sum(copied) / len(copied)


def first_turns(model, tokenizer_dir: Path, count: int) -> list[dict]:
    """The greedy first turns of ``model`` on the first ``count`` held-out questions, each marked
    with whether it is the call of the question's own expression."""
    from opd.models import load_tokenizer

    tokenizer = load_tokenizer(str(tokenizer_dir), "student")
    prompts = generate_task_prompts(f"{TASK.removeprefix('demo:')}@test", seed=0, count=count)
    turns = [
        {
            "question": prompt.messages[0]["content"],
            "turn": turn,
            "right": turn == f"<calc>{expression(prompt)}</calc>",
        }
        for prompt, turn in zip(prompts, greedy_turns(model, tokenizer, prompts), strict=True)
    ]
    print(f"right calls: {sum(t['right'] for t in turns)} of {count}; e.g. {turns[0]}")
    return turns


def bpe_tokenizer():
    """A BPE tokenizer learned on the task's text and the tool calls (every printable character
    kept)."""
    texts = []
    for prompt in generate_task_prompts("arithmetic", seed=0, count=4000):
        texts += [
            prompt.messages[0]["content"],
            f"<calc>{expression(prompt)}</calc>",
            prompt.answer,
            "user",
            "assistant",
            "tool",
        ]
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"\s+|\S+"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    trainer = trainers.BpeTrainer(
        vocab_size=200, special_tokens=list(SPECIAL_TOKENS), initial_alphabet=list(string.printable)
    )
    backend.train_from_iterator(texts, trainer)
    return with_chat_specials(backend)


def build(name: str, spec: demo.DemoModelSpec, tokenizer, prompts: list[Prompt], seed: int) -> Path:
    """Train and save a model (cached)."""
    directory = CACHE / name
    if (directory / "config.json").exists():
        return directory
    model = demo.build_model(spec, tokenizer, seed)
    model.config.max_position_embeddings = 256
    started = time.perf_counter()
    losses = supervised_finetune(
        model,
        ChatRenderer(tokenizer),
        prompts,
        steps=spec.sft_steps,
        batch_size=64,
        learning_rate=spec.sft_learning_rate,
        seed=seed,
    )
    seconds = time.perf_counter() - started
    print(
        f"built {name}: {len(losses)} supervised steps in {seconds:.0f}s, last loss "
        f"{losses[-1]:.3f}"
    )
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)
    return directory


def run_config(
    log_path: Path, student: Path, teacher: dict, steps: int, seed: int, eval_prompts: int
) -> dict:
    return {
        "log_path": str(log_path),
        "seed": seed,
        "eval_every": steps,
        "student": {"model": str(student), "lora_rank": 0, "dtype": "float32", "device": "cpu"},
        "teacher": teacher,
        "datasets": [
            {
                "name": "calc",
                "source": TASK,
                "groups_per_batch": 16,
                "group_size": 4,
                "eval_num_prompts": eval_prompts,
                "env": {"name": "calculator", "max_turns": 3},
            }
        ],
        "training": {
            "learning_rate": 1e-3,
            "max_tokens": MAX_TOKENS,
            "max_steps": steps,
            # the teacher's episodes first, then more and more of the student's: a student that
            # never calls the tool writes nothing the teacher can judge (measured: 0 calls in 60
            # on-policy steps from the start)
            "data_source": "mixed",
            "lmbda": {"start": 0.0, "end": 1.0, "steps": max(steps // 2, 1)},
        },
    }


def serve(teacher: Path) -> tuple[subprocess.Popen, str]:
    """``opd serve`` the teacher on a loopback port; its base URL once it answers."""
    port = free_port()
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "opd.cli",
            "serve",
            str(teacher),
            "--port",
            str(port),
            "--served-model-name",
            "teacher",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    wait_for_health(process, port, timeout_s=120)
    return process, f"http://127.0.0.1:{port}/v1"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--eval-prompts", type=int, default=200)
    parser.add_argument("--teacher", choices=["local", "remote", "bpe"], default="local")
    parser.add_argument("--set", nargs="*", default=[], help="dotted overrides of the run config")
    parser.add_argument("--out", type=Path)
    parser.add_argument(
        "--compare-readings",
        type=int,
        default=0,
        metavar="N",
        help="with --teacher bpe: after each seed, the student samples the two turns of N held-out "
        "prompts and the BPE teacher and its character-level twin read them (tool_use_readings.py)",
    )
    parser.add_argument(
        "--show-calls",
        type=int,
        default=0,
        metavar="N",
        help="after each seed, the final student's greedy first turns on N held-out prompts, and "
        "whether each is the call of the question's own expression",
    )
    parser.add_argument(
        "--teacher-reads",
        nargs="+",
        metavar="TEXT",
        help="only print the BPE teacher's log-prob per character of each TEXT as a first turn",
    )
    parser.add_argument(
        "--compare-answer",
        nargs="+",
        metavar=("EXPRESSION", "TEXT"),
        help="only print, after the right call of EXPRESSION and its result, how the BPE teacher "
        "and its character-level twin read each TEXT as the answer: the likeliest next character",
    )
    args = parser.parse_args()
    if args.teacher_reads:
        print_teacher_reading(args.teacher_reads)
        return
    if args.compare_answer:
        print_answer_readings(args.compare_answer[0], args.compare_answer[1:])
        return

    char = build_char_tokenizer()
    train_prompts = generate_task_prompts("arithmetic", seed=1000, count=4000)
    student = build("student-copying", STUDENT, char, student_turns(train_prompts), seed=1)
    student_reads = reading_rate(student, generate_task_prompts("arithmetic", seed=7, count=100))
    print(f"the student copies the calculator's result after {student_reads:.0%} of right calls")
    if student_reads < MIN_READING:
        sys.exit(
            f"stopped: a student that copies {student_reads:.0%} of the calculator's results "
            "cannot use the tool, so distilling it measures nothing. Its 1500 supervised steps "
            "land on copying or not with the last bit of rounding (docs/environments.md): delete "
            "$OPD_CACHE/tool-use-v2/student-copying and build it at commit 71053e6 (the figures' "
            "student, 91%), or with STUDENT's sft_steps=3000 (96% on the benchmarks machine)"
        )
    if args.teacher == "bpe":
        teacher_dir = build(
            "teacher-bpe", TEACHER, bpe_tokenizer(), tool_turns(train_prompts), seed=0
        )
        teacher = {"model": str(teacher_dir), "cross_tokenizer": True}
    else:
        teacher_dir = build("teacher", TEACHER, char, tool_turns(train_prompts), seed=0)
        teacher = {"model": str(teacher_dir)}
    judges = None
    if args.compare_readings and args.teacher == "bpe":
        build("teacher", TEACHER, char, tool_turns(train_prompts), seed=0)
        judges = readings.Teacher(CACHE / "teacher-bpe"), readings.Teacher(CACHE / "teacher")
        compared = readings.labelled(
            tool_turns(generate_task_prompts("arithmetic", seed=7, count=args.compare_readings))
        )
    server = None
    if args.teacher == "remote":
        server, base_url = serve(teacher_dir)
        teacher = {"backend": "openai", "base_url": base_url, "model": "teacher"}

    results = []
    try:
        for seed in args.seeds:
            log_path = Path(tempfile.mkdtemp(prefix="opd-tool-use-"))
            config = apply_overrides(
                run_config(log_path, student, teacher, args.steps, seed, args.eval_prompts),
                args.set,
            )
            resolved = config_from_dict(config)
            run = train(resolved, progress=False)
            rows = [row for row in run.metrics if "test/calc/accuracy" in row]
            before, after = rows[0], rows[-1]
            results.append(
                {
                    "seed": seed,
                    "objective": resolved.training.objective.name,
                    "off_policy_objective": resolved.training.objective_for("teacher").name,
                    "data_source": resolved.training.data_source,
                    "kl_penalty_coef": resolved.training.kl_penalty_coef,
                    "reward_coef": resolved.training.reward_coef,
                    "success_before": before["test/calc/accuracy"],
                    "success_after": after["test/calc/accuracy"],
                    "turns_before": before["test/calc/turns"],
                    "turns_after": after["test/calc/turns"],
                    "teacher_kl_before": before["test/calc/teacher_kl"],
                    "teacher_kl_after": after["test/calc/teacher_kl"],
                    "tool_calls_last_step": run.metrics[-2].get("env/tool_calls"),
                    "reward_last_step": run.metrics[-2].get("reward/mean"),
                }
            )
            if args.show_calls:
                results[-1]["first_turns"] = first_turns(run.student, student, args.show_calls)
            if judges is not None:
                from opd.saved.export import export_student

                final = export_student(log_path, log_path / "final-student")
                results[-1]["readings"] = readings.disagreement(final, *judges, compared, seed)
            print(results[-1])
            shutil.rmtree(log_path, ignore_errors=True)
        teacher_success = teacher_success_rate(teacher_dir, teacher, args.eval_prompts)
    finally:
        if server is not None:
            server.kill()
    for row in results:
        gap = teacher_success - row["success_before"]
        row["gap_closed"] = (
            (row["success_after"] - row["success_before"]) / gap if gap > 0 else None
        )
    print(
        f"teacher success {teacher_success:.3f}; gap closed per seed: "
        f"{[r['gap_closed'] for r in results]}"
    )
    write_result(
        args.out,
        "tool_use",
        {
            "teacher": args.teacher,
            "steps": args.steps,
            "seeds": args.seeds,
            "eval_prompts": args.eval_prompts,
            "set": args.set,
            "compare_readings": args.compare_readings,
            "show_calls": args.show_calls,
        },
        results,
        teacher_success=teacher_success,
        student_reading_rate=student_reads,
        config=config_to_dict(
            config_from_dict(
                apply_overrides(
                    run_config(
                        Path("<tmp>"),
                        student,
                        teacher,
                        args.steps,
                        args.seeds[0],
                        args.eval_prompts,
                    ),
                    args.set,
                )
            )
        ),
    )


def print_teacher_reading(texts: list[str]) -> None:
    """How the cached BPE teacher reads texts the character-level student might write as its
    first turn (``compute 8703+8754+9870``): its mean log-prob per character, as opd reads a
    cross-tokenizer teacher's answer (its tokens split over characters by its 20 likely ones)."""
    teacher = readings.Teacher(CACHE / "teacher-bpe")
    messages = ({"role": "user", "content": "compute 8703+8754+9870"},)
    for text in texts:
        reading = teacher.read(messages, text)
        per_char = reading.per_character
        print(
            f"{text!r}: {sum(per_char) / len(per_char):.2f} nats per character; the teacher's "
            f"tokens {reading.teacher_tokens}"
        )


def print_answer_readings(expression_text: str, texts: list[str]) -> None:
    """Where the two cached teachers part on an answer turn: after each prefix of the text, each
    one's likeliest next character (``<end>``: the end of turn) and the KL between their
    readings."""
    result = calculate(expression_text)
    question = Prompt(({"role": "user", "content": f"compute {expression_text}"},), answer=result)
    messages = tool_turns([question])[1].messages
    bpe, char = readings.Teacher(CACHE / "teacher-bpe"), readings.Teacher(CACHE / "teacher")
    print(f"the calculator's result: {result}")
    for text in texts:
        by_bpe, by_char = bpe.read(messages, text), char.read(messages, text)
        rows = zip(by_bpe.next_characters, by_char.next_characters, strict=True)
        for at, (b_row, c_row) in enumerate(rows):
            print(
                f"after {text[:at]!r}: BPE {likeliest(b_row, char.char)}, character-level "
                f"{likeliest(c_row, char.char)}, KL {readings.kl(c_row, b_row):.2f}"
            )


def likeliest(row: dict[int, float], tokenizer) -> str:
    """A next-character reading's top choice and its probability."""
    best = max(row, key=row.get)
    shown = "<end>" if best == readings.STUDENT_STOP_ID else tokenizer.decode([best])
    return f"{shown!r} {math.exp(row[best]):.3f}"


def teacher_success_rate(teacher_dir: Path, teacher: dict, eval_prompts: int) -> float:
    """The teacher's own held-out success, greedy episodes in the same environment."""
    from opd.assemble.eval_sets import load_eval_sets
    from opd.models import load_causal_lm, load_tokenizer
    from opd.runs.evaluation import evaluate
    from opd.sampling.hf_generate import HFGenerateSampler

    config = config_from_dict(
        run_config(
            Path(tempfile.mkdtemp()), teacher_dir, {"model": str(teacher_dir)}, 1, 0, eval_prompts
        )
    )
    tokenizer = load_tokenizer(str(teacher_dir), "teacher")
    renderer = ChatRenderer(tokenizer)
    model = load_causal_lm(str(teacher_dir), "teacher", dtype="float32", device="cpu")
    sampler = HFGenerateSampler(model, tokenizer, stop_token_ids=renderer.stop_token_ids)
    eval_sets = load_eval_sets(config, None)
    metrics = evaluate(
        sampler,
        renderer,
        eval_sets,
        temperature=1.0,
        max_tokens=MAX_TOKENS,
        seed=0,
        pad_id=tokenizer.pad_token_id,
    )
    return metrics["test/calc/accuracy"]


if __name__ == "__main__":
    main()
