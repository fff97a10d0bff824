"""Packed vs padded micro-batches on length-skewed rows: update time, teacher time, peak memory.

The rows: SmolLM2's own samples (temperature 1) of `--rows` prompts, half of them a word to
reverse (short answers), half the same asked step by step (long ones), each cut to a length
drawn log-uniformly between 4 and `--max-tokens` tokens (a sample that stopped sooner keeps its
length): completions spread from a few tokens to the limit. Every mode works on the same rows,
in a process of its own (peak = the process's memory high-water mark, both models and AdamW's
state included):

  padded        opd before packing: one micro-batch of every row, padded to the longest
  packed        the defaults: packed micro-batches within the token budget sized for the
                device, sdpa run per sequence
  packed-mask   packed, attention through transformers' block-diagonal sdpa mask instead

Each mode times the local teacher's scoring and the student's update (the run's default
objective, `topk_forward_kl` k 20, full fine-tuning, float32) `--repeats` times after one
warm-up, in each of `--rounds` rounds that take the modes in turn (the machine's drift falls
on all alike), and prints medians and the ratios to `padded` measured in this run.

    python bench/packing.py --model ~/.cache/opd/smollm2-135m-instruct --out
    docs/results/packing.json
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import random
import resource
import statistics
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path

from provenance import write_result

MODES = {
    "padded": {"packing": False, "micro_batch_size": 10_000},
    "packed": {},
    "packed-mask": {},
}


def config(args, directory: str, settings: dict) -> dict:
    prompt_file = Path(directory) / "prompts.jsonl"
    if not prompt_file.exists():
        from opd.data.builtin_tasks import generate_task_prompts

        words = [
            p.messages[0]["content"]
            for p in generate_task_prompts("reverse", seed=7, count=args.rows)
        ]
        asked = [
            w + (" Explain every step, then give the answer." if i % 2 else "")
            for i, w in enumerate(words)
        ]
        prompt_file.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in asked))
    return {
        "log_path": str(Path(directory) / "run"),
        "eval_every": 0,
        "save_every": 0,
        "student": {"model": args.model, "device": "cpu"},
        "teacher": {"model": args.teacher or args.model, "device": "cpu"},
        "datasets": [
            {
                "name": "bench",
                "source": str(prompt_file),
                "groups_per_batch": args.rows,
                "group_size": 1,
            }
        ],
        "training": {"max_tokens": args.max_tokens, "learning_rate": 1e-5, "max_steps": 1}
        | settings,
    }


def make_rows(args, directory: str) -> None:
    """Sample the rows once and cut them to their skewed lengths; saved as tensors."""
    import torch

    from opd.config import config_from_dict
    from opd.trainer.loop import Trainer

    trainer = Trainer(config_from_dict(config(args, directory, {})), progress=False)
    batch, _ = trainer.collector.sample_batch(0)
    rng = random.Random(args.seed)
    for row, prompt_length in enumerate(batch.prompt_lengths):
        sampled = int(batch.mask_BT[row].sum())
        keep = min(sampled, round(math.exp(rng.uniform(math.log(4), math.log(args.max_tokens)))))
        end = prompt_length + keep
        batch.attention_mask_BT[row, end:] = 0
        batch.mask_BT[row, end:] = 0
        batch.sampled_logprobs_BT[row, end:] = 0
        batch.input_ids_BT[row, end:] = trainer.parts.engine.pad_id
    tensors = {
        "input_ids": batch.input_ids_BT,
        "attention": batch.attention_mask_BT,
        "mask": batch.mask_BT,
        "sampled": batch.sampled_logprobs_BT,
        "prompt_lengths": torch.tensor(batch.prompt_lengths),
    }
    torch.save(tensors, Path(directory) / "rows.pt")


def run_mode(args, directory: str, mode: str) -> dict:
    import torch

    import opd.packing
    from opd.config import config_from_dict
    from opd.data.sequences import RolloutBatch
    from opd.trainer.loop import Trainer
    from opd.trainer.update import policy_gradient, policy_update

    if (
        mode == "packed-mask"
    ):  # transformers sees packed position ids and no mask: its block-diagonal mask
        opd.packing.per_sequence_attention = lambda backbone: nullcontext()
    trainer = Trainer(config_from_dict(config(args, directory, MODES[mode])), progress=False)
    saved = torch.load(Path(directory) / "rows.pt", weights_only=True)
    rows = len(saved["prompt_lengths"])
    batch = RolloutBatch(
        saved["input_ids"],
        saved["attention"],
        saved["mask"],
        saved["sampled"],
        torch.zeros(rows, dtype=torch.long),
        torch.ones(rows, dtype=torch.bool),
        saved["prompt_lengths"].tolist(),
        [],
        torch.zeros(rows, dtype=torch.long),
    )
    training = trainer.parts.config.training
    teacher_seconds, update_seconds = [], []
    for _ in range(args.repeats + 1):
        started = time.perf_counter()
        scores = trainer.parts.teachers.score(batch)
        scored = time.perf_counter()
        advantages = trainer.parts.objective.advantages(
            batch.sampled_logprobs_BT, scores, batch.mask_BT, policy_gradient(training)
        )
        policy_update(
            trainer.parts.policy,
            trainer.parts.objective,
            trainer.parts.optimizer,
            trainer.parts.scheduler,
            batch,
            scores,
            torch.zeros_like(batch.mask_BT) if advantages is None else advantages,
            training,
            trainer.parts.batching,
        )
        update_seconds.append(time.perf_counter() - scored)
        teacher_seconds.append(scored - started)
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    lengths = batch.attention_mask_BT.sum(-1)
    micro_batches = trainer.parts.batching.split(batch)
    return {
        "teacher_seconds": teacher_seconds[1:],
        "update_seconds": update_seconds[1:],
        "peak_mib": peak_mib,
        "token_budget": trainer.parts.batching.tokens,
        "micro_batches": len(micro_batches),
        "packed": trainer.parts.batching.packed,
        "tokens": int(lengths.sum()),
        "padded_tokens": rows * int(lengths.max()),
        "completion_lengths": batch.mask_BT.sum(-1).int().tolist(),
    }


def child(args, directory: str, mode: str | None) -> None:
    """One mode in a fresh process (or, with no mode, the rows made once)."""
    name = mode or "rows"
    with open(Path(directory) / f"{name}.log", "w") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
    if mode is None:
        make_rows(args, directory)
        return
    (Path(directory) / f"{name}.json").write_text(json.dumps(run_mode(args, directory, mode)))


def spawn(args, directory: str, mode: str | None) -> dict | None:
    context = multiprocessing.get_context("spawn")
    process = context.Process(target=child, args=(args, directory, mode))
    process.start()
    process.join()
    name = mode or "rows"
    if process.exitcode:
        log = (Path(directory) / f"{name}.log").read_text()
        raise RuntimeError(f"{name} failed (exit code {process.exitcode}):\n{log[-3000:]}")
    return json.loads((Path(directory) / f"{name}.json").read_text()) if mode else None


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", required=True, help="the student (and teacher unless --teacher)")
    parser.add_argument("--teacher")
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=2, help="timed repeats per mode and round")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--modes", nargs="*", default=list(MODES), choices=list(MODES))
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    args.model = str(Path(args.model).expanduser())
    args.teacher = str(Path(args.teacher).expanduser()) if args.teacher else None
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as directory:
        spawn(args, directory, None)
        for _ in range(args.rounds):
            for mode in args.modes:
                result = spawn(args, directory, mode)
                if mode not in results:
                    results[mode] = result | {"peak_mib": [result["peak_mib"]]}
                    continue
                for key in ("teacher_seconds", "update_seconds"):
                    results[mode][key] += result[key]
                results[mode]["peak_mib"].append(result["peak_mib"])
    base = results.get("padded")
    first = next(iter(results.values()))
    lengths = first["completion_lengths"]
    print(
        f"{len(lengths)} rows, completions of {min(lengths)}-{max(lengths)} tokens; "
        f"{first['tokens']} tokens, {first['padded_tokens']} padded"
    )
    header = ("mode", "update s", "ratio", "teacher s", "ratio", "peak MiB", "ratio")
    print("{:<12} {:>9} {:>6} {:>10} {:>6} {:>9} {:>10} micro-batches".format(*header))
    for mode, result in results.items():
        update = statistics.median(result["update_seconds"])
        teacher = statistics.median(result["teacher_seconds"])
        peak = max(result["peak_mib"])
        ratios = ("", "", "")
        if base:
            # peaks compared round by round (a process's high-water mark moves between rounds):
            # the range over rounds, never one round's figure alone
            rounds = [a / b for a, b in zip(result["peak_mib"], base["peak_mib"], strict=True)]
            ratios = (
                f"{update / statistics.median(base['update_seconds']):.2f}x",
                f"{teacher / statistics.median(base['teacher_seconds']):.2f}x",
                f"{min(rounds):.2f}-{max(rounds):.2f}x",
            )
            result["update_vs_padded"] = float(ratios[0][:-1])
            result["teacher_vs_padded"] = float(ratios[1][:-1])
            result["peak_vs_padded_by_round"] = [round(r, 3) for r in rounds]
        print(
            f"{mode:<12} {update:>9.2f} {ratios[0]:>6} {teacher:>10.2f} {ratios[1]:>6} "
            f"{peak:>9.0f} {ratios[2]:>10} {result['micro_batches']}"
        )
    if args.out:
        settings = {key: value for key, value in vars(args).items() if key != "out"}
        write_result(args.out, "packing", settings, results, modes_described=MODES)


if __name__ == "__main__":
    main()
