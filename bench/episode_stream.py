"""Episodes streamed into vLLM's running batch against every row waiting for the batch's slowest
turn: episodes per second of a step's sampling, and whether the two draw the same tokens.

SmolLM2-135M-Instruct plays the ``calculator`` environment on ``demo:arithmetic`` (told in a
system message that it may write ``<calc>EXPRESSION</calc>``, shown two worked episodes),
sampled by opd's in-process vLLM engine (``student.sampler: vllm``). Each timed step samples
the same rows twice: once with each turn submitted as soon as its row's environment answered
(opd's default with a vLLM engine), once in lock step (the engine's turn stream hidden: one
``generate`` call a turn for every row still playing); the order alternates from step to step.
Run alone (nothing else on the CPU):

    python bench/episode_stream.py --model ~/.cache/opd/smollm2-135m-instruct \\
        --out docs/results/episode_stream.json

``--tool-delay S --step-workers N``: the calculator answers after ``S`` seconds (a tool that
waits), and each step is also sampled both ways with ``env.step_workers: N`` (answers in N threads
beside the engine): four variants a step, the order rotating.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import tempfile
import time
from pathlib import Path

from provenance import write_result

from opd.config import config_from_dict, config_to_dict
from opd.data.builtin_tasks import generate_task_prompts
from opd.envs.calculator import Calculator, CalculatorEpisode
from opd.trainer.loop import Trainer

SYSTEM = (
    "You can use a calculator: write <calc>EXPRESSION</calc> (numbers, + - * / and parentheses) "
    "and you will be told its value. When you know the answer, reply with the number only."
)
SHOTS = [
    {"role": "user", "content": "compute 1234+5678"},
    {"role": "assistant", "content": "<calc>1234+5678</calc>"},
    {"role": "tool", "content": "6912"},
    {"role": "assistant", "content": "6912"},
    {"role": "user", "content": "compute 9012-345+67"},
    {"role": "assistant", "content": "<calc>9012-345+67</calc>"},
    {"role": "tool", "content": "8734"},
    {"role": "assistant", "content": "8734"},
]
"""Two worked episodes before the question: without them SmolLM2 called the tool in 0 of 16
answers, with them in 13 of 16 (measured at temperature 1)."""


@dataclasses.dataclass
class SlowCalculatorEpisode(CalculatorEpisode):
    delay: float = 0.0

    def step(self, reply: str):
        time.sleep(self.delay)
        return super().step(reply)


@dataclasses.dataclass(frozen=True)
class SlowCalculator(Calculator):
    """The calculator, answering after ``delay`` seconds (a tool behind a network call)."""

    delay: float = 0.0

    def start(self, prompt, grader) -> SlowCalculatorEpisode:
        episode = super().start(prompt, grader)
        return SlowCalculatorEpisode(**vars(episode), delay=self.delay)


class InLockStep:
    """The run's engine with its turn stream hidden: a turn of every row still playing at a time."""

    turn_stream = None

    def __init__(self, engine):
        self.engine = engine

    def __getattr__(self, name):
        return getattr(self.engine, name)


def prompts_file(path: Path, count: int) -> Path:
    rows = generate_task_prompts("arithmetic", seed=0, count=count)
    with path.open("w") as out:
        for prompt in rows:
            messages = [{"role": "system", "content": SYSTEM}, *SHOTS, *prompt.messages]
            out.write(json.dumps({"messages": messages, "answer": prompt.answer}) + "\n")
    return path


def run_config(args, prompts: Path, log_path: Path) -> dict:
    return {
        "log_path": str(log_path),
        "seed": 0,
        "student": {
            "model": str(args.model),
            "lora_rank": 0,
            "sampler": "vllm",
            "sampler_options": {"max_num_seqs": args.prompts * args.group_size},
        },
        "teacher": {"model": str(args.model)},
        "datasets": [
            {
                "name": "calc",
                "source": str(prompts),
                "groups_per_batch": args.prompts,
                "group_size": args.group_size,
                "env": {
                    "name": "episode_stream:SlowCalculator" if args.tool_delay else "calculator",
                    **({"delay": args.tool_delay} if args.tool_delay else {}),
                    "max_turns": args.max_turns,
                    "max_episode_tokens": args.episode_tokens,
                },
            }
        ],
        "training": {"max_tokens": args.max_tokens, "temperature": 1.0, "max_steps": args.steps},
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model", type=Path, default=Path.home() / ".cache/opd/smollm2-135m-instruct"
    )
    parser.add_argument("--prompts", type=int, default=32, help="prompts a step")
    parser.add_argument("--group-size", type=int, default=1)
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens a turn at most")
    parser.add_argument("--max-turns", type=int, default=4)
    parser.add_argument("--episode-tokens", type=int, default=320, help="tokens an episode at most")
    parser.add_argument("--steps", type=int, default=4, help="timed steps (each sampled both ways)")
    parser.add_argument(
        "--tool-delay", type=float, default=0.0, help="seconds each tool answer takes"
    )
    parser.add_argument(
        "--step-workers", type=int, default=1, help="also sample with env.step_workers N (N > 1)"
    )
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="episode-stream-"))
    prompts = prompts_file(work / "prompts.jsonl", args.prompts * (args.steps + 1))
    config = config_from_dict(run_config(args, prompts, work / "run"))
    trainer = Trainer(config, progress=False)
    dataset = trainer.parts.config.datasets[0]
    engines = {"streamed": trainer.parts.engine, "lockstep": InLockStep(trainer.parts.engine)}
    variants = {name: (engine, 1) for name, engine in engines.items()}
    if args.step_workers > 1:
        variants |= {
            f"{name}-threads": (engine, args.step_workers) for name, engine in engines.items()
        }

    def timed(step: int, name: str) -> tuple[float, object]:
        trainer.parts.engine, workers = variants[name]
        dataset.env = dataclasses.replace(dataset.env, step_workers=workers)
        started = time.perf_counter()
        sampled = trainer.collector.sample(step)
        return time.perf_counter() - started, sampled.rollouts

    for name in variants:  # warm up every path (first calls build vLLM's caches)
        timed(args.steps, name)

    names = list(variants)
    steps = []
    for step in range(args.steps):
        order = names[step % len(names) :] + names[: step % len(names)]
        record = {"step": step}
        rollouts = {}
        for name in order:
            seconds, rollouts[name] = timed(step, name)
            record[f"{name}_s"] = seconds
        a = rollouts["streamed"]
        rows = len(a.trajectories)
        for name in names[1:]:
            b = rollouts[name]
            record[f"same_episodes_{name}"] = sum(
                a.trajectories[r] == b.trajectories[r]
                and a.input_ids_BT[r][a.attention_mask_BT[r].bool()].tolist()
                == b.input_ids_BT[r][b.attention_mask_BT[r].bool()].tolist()
                for r in range(rows)
            )
        turns = [len(t.turns) for t in a.trajectories]
        record |= {
            "episodes": rows,
            "same_episodes": record["same_episodes_lockstep"],
            "turns_mean": statistics.mean(turns),
            "turns_max": max(turns),
            "tool_calls": sum(t.metrics.get("tool_calls", 0.0) for t in a.trajectories),
            "sampled_tokens": int(a.mask_BT.sum()),
            "success": statistics.mean(float((t.reward or 0.0) >= 1.0) for t in a.trajectories),
        }
        steps.append(record)
        times = ", ".join(f"{name} {record[f'{name}_s']:.2f} s" for name in names)
        print(
            f"step {step}: {times}; {record['same_episodes']}/{rows} episodes the same streamed "
            f"and in lock step; turns mean {record['turns_mean']:.2f} max {record['turns_max']}, "
            f"{record['tool_calls']:.0f} tool calls",
            flush=True,
        )

    episodes = sum(r["episodes"] for r in steps)
    seconds = {name: sum(r[f"{name}_s"] for r in steps) for name in names}
    summary = {
        "episodes": episodes,
        **{f"{name}_episodes_per_s": episodes / seconds[name] for name in names},
        "streamed_vs_lockstep_time": seconds["streamed"] / seconds["lockstep"],
        "per_step_time_ratios": [r["streamed_s"] / r["lockstep_s"] for r in steps],
        **{
            f"same_episodes_{name}": sum(r[f"same_episodes_{name}"] for r in steps)
            for name in names[1:]
        },
        "same_episodes": sum(r["same_episodes"] for r in steps),
    }
    for name in names[2:]:
        base = name.removesuffix("-threads")
        summary[f"{name}_vs_{base}_time"] = seconds[name] / seconds[base]
    print(
        "episodes/s: "
        + ", ".join(f"{name} {summary[f'{name}_episodes_per_s']:.3f}" for name in names)
        + f"; time streamed / lock step {summary['streamed_vs_lockstep_time']:.2f}; "
        + ", ".join(
            f"{name}: {summary[f'same_episodes_{name}']}/{episodes} the same" for name in names[1:]
        )
    )
    write_result(
        args.out,
        "bench/episode_stream.py",
        vars(args),
        {"steps": steps, "summary": summary},
        config=config_to_dict(config),
    )


if __name__ == "__main__":
    main()
