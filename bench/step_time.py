"""Seconds per step and peak memory: opd vs TRL's DistillationTrainer on identical work.

Both train the same student against the same teacher on the same prompts: `--prompts` prompts
per step, one completion each, at most `--max-tokens` tokens, temperature 1, full
fine-tuning or LoRA (rank 16, all linear layers). TRL's trainer is always on-policy with a
full-vocabulary generalized JSD (beta 1 = reverse KL), so opd runs the same objective
(`jsd`, beta 1); the reference recipe's `sampled_reverse_kl` is measured too. Each (tool, mode,
repeat) runs in its own process, alternating, so peak memory (the process's high-water mark)
is its own; the first step of each run is a warm-up and not timed.

    pip install 'trl>=1.11'              # and vLLM for the opd-*-vllm tools (docs/vllm.md)
    python bench/step_time.py --quick            # tiny demo models (run `opd demo` once first)
    python bench/step_time.py --student DIR --teacher DIR --steps 4 --repeats 3 --out result.json

Prints medians and the opd/TRL ratios measured in this run.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import resource
import statistics
import tempfile
import time
from pathlib import Path

from provenance import write_result

# tool -> what it runs; ratios are against "trl" (TRL in float32, as opd trains)
TOOLS = {
    "trl": "TRL DistillationTrainer, float32",
    "trl-bf16": "TRL with bf16=True (its default: bfloat16 autocast for generation and training)",
    "trl-vllm": "TRL with its colocated vLLM (use_vllm=True, vllm_mode colocate), float32",
    "opd-jsd": "opd jsd beta 1 (TRL's objective), float32",
    "opd-sampled": "opd sampled_reverse_kl, float32",
    "opd-topk": "opd topk_forward_kl (k 32: what a vLLM / SGLang teacher can serve), float32",
    "opd-jsd-padded": "opd jsd, every row of a step in one padded micro-batch (opd before packing)",
    "opd-sampled-padded": "opd sampled_reverse_kl, one padded micro-batch (opd before packing)",
    "opd-jsd-bf16s": "opd jsd, rollouts from a bfloat16 copy (student.sampling_dtype)",
    "opd-sampled-bf16s": "opd sampled_reverse_kl, rollouts from a bfloat16 copy",
    "opd-jsd-f32s": "opd jsd, rollouts from a float32 copy (LoRA merged into it: identical float32 "
    "work)",
    "opd-sampled-f32s": "opd sampled_reverse_kl, rollouts from a float32 copy (LoRA merged)",
    "opd-jsd-mixed": "opd jsd at trl-bf16's precision: bfloat16 sampling copy, teacher and "
    "autocast update",
    "opd-sampled-mixed": "opd sampled_reverse_kl at trl-bf16's precision (as opd-jsd-mixed)",
    "opd-jsd-vllm": "opd jsd, rollouts by the in-process vLLM engine (student.sampler: vllm), "
    "float32",
    "opd-sampled-vllm": "opd sampled_reverse_kl, rollouts by vLLM (LoRA: merged weights pushed)",
    "opd-sampled-vllmad": "opd sampled_reverse_kl, rollouts by vLLM (LoRA: adapter hot-loaded)",
}
OBJECTIVES = {"jsd": "jsd", "sampled": "sampled_reverse_kl", "topk": "topk_forward_kl"}
SAMPLING_DTYPES = {"-bf16s": "bfloat16", "-f32s": "float32", "-mixed": "bfloat16"}
MIXED = "-mixed"  # also runs the update under bfloat16 autocast and the teacher in bfloat16
VLLM = {"-vllm": "merged", "-vllmad": "adapter"}  # student.sampler: vllm, and its student.lora_sync
PADDED = "-padded"  # training.packing off, one micro-batch of every row
PHASES = ("sample", "teacher", "train")  # opd's own time/* metrics, printed beside the totals
# (time/sample includes the weight sync of the vLLM tools)


def prompts(count: int) -> list[str]:
    from opd.data.builtin_tasks import generate_task_prompts

    return [
        p.messages[0]["content"] for p in generate_task_prompts("reverse", seed=123, count=count)
    ]


def run_trl(args, steps: int, bf16: bool, vllm: bool = False) -> dict:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import DistillationTrainer
    from trl_setup import distillation_config, lora_config

    tokenizer = AutoTokenizer.from_pretrained(args.student)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    data = Dataset.from_list(
        [{"prompt": [{"role": "user", "content": p}]} for p in prompts(args.prompts * steps)]
    )
    step_times: list[float] = []

    class Timer(TrainerCallback):
        def on_step_begin(self, *_, **__):
            self.started = time.perf_counter()

        def on_step_end(self, *_, **__):
            step_times.append(time.perf_counter() - self.started)

    with tempfile.TemporaryDirectory() as output:
        config = distillation_config(
            output,
            per_device_train_batch_size=args.prompts,
            max_completion_length=args.max_tokens,
            temperature=1.0,
            beta=1.0,
            learning_rate=1e-5,
            max_steps=steps,
            use_cpu=args.device == "cpu",
            bf16=bf16,
            **(
                {"use_vllm": True, "vllm_mode": "colocate", "vllm_max_model_length": 1024}
                if vllm
                else {}
            ),
        )
        trainer = DistillationTrainer(
            model=AutoModelForCausalLM.from_pretrained(args.student),
            teacher_model=AutoModelForCausalLM.from_pretrained(args.teacher),
            args=config,
            train_dataset=data,
            processing_class=tokenizer,
            peft_config=lora_config(16) if args.mode == "lora" else None,
            callbacks=[Timer()],
        )
        trainer.train()
    return {"step_seconds": step_times[1:], "tokens": None, "phases": {}}


def run_opd(
    args,
    steps: int,
    objective: str,
    sampling_dtype: str | None,
    mixed: bool,
    lora_sync: str | None,
    padded: bool = False,
) -> dict:
    from opd.config import config_from_dict
    from opd.trainer.loop import Trainer

    with tempfile.TemporaryDirectory() as directory:
        prompt_file = Path(directory) / "prompts.jsonl"
        prompt_file.write_text(
            "".join(json.dumps({"prompt": p}) + "\n" for p in prompts(args.prompts * steps))
        )
        config = config_from_dict(
            {
                "log_path": str(Path(directory) / "run"),
                "eval_every": 0,
                "save_every": 0,
                "student": {
                    "model": args.student,
                    "lora_rank": 16 if args.mode == "lora" else 0,
                    "device": args.device,
                    "sampling_dtype": sampling_dtype,
                    **({"sampler": "vllm", "lora_sync": lora_sync} if lora_sync else {}),
                },
                "teacher": {
                    "model": args.teacher,
                    "device": args.device,
                    "dtype": "bfloat16" if mixed else "auto",
                },
                "datasets": [
                    {
                        "name": "bench",
                        "source": str(prompt_file),
                        "groups_per_batch": args.prompts,
                        "group_size": 1,
                    }
                ],
                "training": {
                    "objective": {
                        "name": objective,
                        **({"beta": 1.0} if objective == "jsd" else {}),
                    },
                    "learning_rate": 1e-5,
                    "max_tokens": args.max_tokens,
                    "temperature": 1.0,
                    "max_steps": steps,
                    "autocast": "bfloat16" if mixed else None,
                    **({"packing": False, "micro_batch_size": args.prompts} if padded else {}),
                },
            }
        )
        trainer = Trainer(config, progress=False)
        rows = [trainer.train_step(step) for step in range(steps)]
    return {
        "step_seconds": [r["time/total"] for r in rows[1:]],
        "tokens": [r["num_tokens"] for r in rows[1:]],
        "phases": {phase: [r[f"time/{phase}"] for r in rows[1:]] for phase in PHASES},
    }


def child(args, tool: str, mode: str, directory: str) -> None:
    """One (tool, mode) run in its own process: its output to `log`, its result as JSON to
    `result.json`."""
    with open(Path(directory) / "log", "w") as log:  # fds 1 and 2 stay open on it after the with
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
    args.mode = mode
    steps = args.steps + 1
    if tool.startswith("trl"):
        if (
            tool == "trl-vllm"
        ):  # what opd's engine sets on a CPU (docs/vllm.md): TRL leaves vLLM's defaults
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        result = run_trl(args, steps, bf16=tool == "trl-bf16", vllm=tool == "trl-vllm")
    else:
        objective = OBJECTIVES[tool.split("-")[1]]
        suffix = "-" + tool.rpartition("-")[2]
        result = run_opd(
            args,
            steps,
            objective,
            SAMPLING_DTYPES.get(suffix),
            mixed=suffix == MIXED,
            lora_sync=VLLM.get(suffix),
            padded=suffix == PADDED,
        )
    result["peak_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    (Path(directory) / "result.json").write_text(json.dumps(result))


def measure(context: multiprocessing.context.BaseContext, args, tool: str, mode: str) -> dict:
    """Run `child` in a process of `context` and read back what it wrote."""
    with tempfile.TemporaryDirectory() as directory:
        process = context.Process(target=child, args=(args, tool, mode, directory))
        process.start()
        process.join()
        result_path = Path(directory) / "result.json"
        if process.exitcode or not result_path.exists():
            log = (Path(directory) / "log").read_text()
            raise RuntimeError(
                f"{tool} {mode} failed (exit code {process.exitcode}):\n{log[-3000:]}"
            )
        return json.loads(result_path.read_text())


def process_context(quick: bool) -> multiprocessing.context.BaseContext:
    """A fresh interpreter per run (spawn), so each peak is the run's own, libraries included.

    `--quick` forks each run from a server that has imported torch and transformers once: the
    imports (about 5 s a run on a 2-core CPU) would otherwise take most of its minute. Pages of
    those libraries then count towards a run's peak only once it touches them, alike for both tools.
    """
    if not quick:
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["torch", "transformers"])
    return context


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--quick", action="store_true", help="the demo's tiny models (cached by `opd demo`)"
    )
    parser.add_argument("--student")
    parser.add_argument("--teacher")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument(
        "--steps",
        type=int,
        help="timed steps per run, after one warm-up step (default 4; 2 with --quick)",
    )
    parser.add_argument(
        "--repeats", type=int, help="runs per (tool, mode) (default 3; 1 with --quick)"
    )
    parser.add_argument("--modes", nargs="*", default=["full", "lora"], choices=["full", "lora"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--tools",
        nargs="*",
        default=["trl", "opd-jsd", "opd-sampled"],
        choices=list(TOOLS),
        help="; ".join(f"{tool}: {what}" for tool, what in TOOLS.items()) + " (trl is always run)",
    )
    parser.add_argument(
        "--out", type=Path, help="also write the results here as JSON, with their provenance"
    )
    args = parser.parse_args()
    args.steps = args.steps or (2 if args.quick else 4)
    args.repeats = args.repeats or (1 if args.quick else 3)
    if args.quick:
        from opd.demo.run import cache_dir

        cache = cache_dir()
        args.student, args.teacher = str(cache / "student"), str(cache / "teacher")
        args.max_tokens = min(args.max_tokens, 10)
    if not (args.student and args.teacher):
        parser.error("give --student and --teacher, or --quick")
    print(
        f"student {args.student}, teacher {args.teacher}; {args.prompts} prompts x 1 completion, "
        f"<= {args.max_tokens} tokens, {args.steps} timed steps x {args.repeats} repeats, "
        f"{args.device}"
    )
    tools = ["trl"] + [tool for tool in args.tools if tool != "trl"]
    os.environ["TQDM_DISABLE"] = "1"  # inherited by the runs: no progress bars in the table
    context = process_context(args.quick)
    versus_bf16 = "trl-bf16" in tools  # the mixed-precision rows' own baseline, as a second ratio
    print(
        f"{'mode':>5} {'tool':>17} {'s/step':>8} {'vs TRL':>7} {'tokens/s':>9} {'peak MiB':>9} "
        f"{'vs TRL':>7}"
        + (f" {'vs TRL bf16':>11}" if versus_bf16 else "")
        + f"  {' / '.join(PHASES)} (opd, median s)"
    )
    rows = []
    for mode in args.modes:
        runs: dict[str, list[dict]] = {tool: [] for tool in tools}
        failures: dict[str, str] = {}
        for _ in range(args.repeats):
            for tool in tools:
                if tool in failures:
                    continue
                try:
                    runs[tool].append(measure(context, args, tool, mode))
                except (
                    RuntimeError
                ) as error:  # a peer that cannot run here is a finding, not the end
                    if tool == "trl":
                        raise
                    failures[tool] = str(error).strip().splitlines()[-1]
        for tool, reason in failures.items():
            print(f"{mode:>5} {tool:>17} failed: {reason}")
            rows.append({"mode": mode, "tool": tool, "failed": reason})
            del runs[tool]
        summary = {}
        for tool, results in runs.items():
            seconds = statistics.median(s for r in results for s in r["step_seconds"])
            tokens = [t for r in results for t in (r["tokens"] or [])]
            phases = {
                phase: statistics.median(s for r in results for s in r["phases"][phase])
                for phase in (PHASES if results[0]["phases"] else ())
            }
            summary[tool] = (
                seconds,
                statistics.median(r["peak_mib"] for r in results),
                tokens,
                phases,
            )
        for tool, (seconds, peak, tokens, phases) in summary.items():
            rate = f"{statistics.mean(tokens) / seconds:9.0f}" if tokens else f"{'n/a':>9}"
            print(
                f"{mode:>5} {tool:>17} {seconds:8.3f} {seconds / summary['trl'][0]:7.2f} {rate} "
                f"{peak:9.0f} {peak / summary['trl'][1]:7.2f}"
                + (f" {seconds / summary['trl-bf16'][0]:11.2f}" if versus_bf16 else "")
                + "  "
                + " / ".join(f"{phases[phase]:.2f}" for phase in phases)
            )
            rows.append(
                {
                    "mode": mode,
                    "tool": tool,
                    "seconds_per_step": seconds,
                    "vs_trl": seconds / summary["trl"][0],
                    "peak_mib": peak,
                    "peak_vs_trl": peak / summary["trl"][1],
                    "phases": phases,
                    "runs": runs[tool],
                }
            )
    settings = {k: v for k, v in vars(args).items() if k != "out"}
    write_result(args.out, "bench/step_time.py", settings, rows, tools={t: TOOLS[t] for t in tools})


if __name__ == "__main__":
    main()
