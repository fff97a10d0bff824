"""One GPU's check of opd, in one command that fits a few minutes of an H100: speed and equalities
on a Qwen3-0.6B-shaped student and a Qwen3-1.7B-shaped teacher (random weights, bfloat16; the
shapes are bench/configs/*.json), one JSON result and a short table.

Sections (each timed; one that fails is recorded and the next runs; past ``--budget-s`` the
rest are skipped and said so):

- ``packing``: the teacher's log-probs of the same rows packed and padded (the attention path
  named), the largest difference against the stated bfloat16 tolerance, each pass timed apart
  with the tokens its forwards were given (packed: the rows' own; padded: rows x width);
- ``update``: the student's update on rows of 512 tokens at a few micro-batch token budgets,
  with and without gradient checkpointing: tokens/s, MFU (6 x parameters x tokens / seconds /
  the GPU's dense bf16 peak), peak memory against the estimate ``opd train --dry-run`` makes;
- ``sampler``: HF generate at batch 64 and 256, tokens/s against the memory-bandwidth floor
  (every decode step reads the weights once);
- ``teacher``: the local teacher's scoring, tokens/s;
- ``resume``: a 10-step ``opd train`` with a checkpoint every 3 steps, SIGKILLed after 5 rows and
  run again, against the uninterrupted run (bfloat16 tolerance), and ``kl_sample_train`` of a
  bfloat16 sampler.

    python bench/gpu_check.py --out docs/results/gpu_check.json     # on the GPU, ~5 minutes
    python bench/gpu_check.py --cpu --tiny                           # every section, tiny, on the
    CPU (CI)

On the GPU machine opd goes in over the image's packages: ``pip install --no-deps -e .``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from provenance import write_result  # noqa: E402

PEAKS = {  # (dense bf16 FLOP/s, memory bytes/s): vendors' figures
    "H100 SXM": (989e12, 3.35e12),
    "H100 80GB HBM3": (989e12, 3.35e12),
    "H100 PCIe": (756e12, 2.0e12),
    "H100 NVL": (835e12, 3.9e12),
    "H200": (989e12, 4.8e12),
    "A100": (312e12, 2.0e12),
}
TINY = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 512,
}
BF16_TOLERANCE = 0.05
"""Packed against padded in bfloat16: the largest log-prob difference allowed (a bfloat16 value
near -10 is 0.06 apart from its neighbours; the two paths sum in different orders)."""


def peaks(device) -> tuple[float | None, float | None]:
    import torch

    if device.type != "cuda":
        return None, None
    name = torch.cuda.get_device_name(device)
    for key, values in PEAKS.items():
        if all(part in name for part in key.split()):
            return values
    return None, None


def build_models(root: Path, tiny: bool, device, dtype) -> dict[str, Path]:
    """The student and teacher, random weights from the shapes in bench/configs, saved with the
    character tokenizer (ids within its size; the embedding keeps the shape's full vocabulary)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from opd.demo.char_tokenizer import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    paths = {}
    for name, shape in (("student", "qwen3-0.6b"), ("teacher", "qwen3-1.7b")):
        values = json.loads((HERE / "configs" / f"{shape}.json").read_text())
        values |= TINY if tiny else {}
        values |= {"pad_token_id": tokenizer.pad_token_id, "eos_token_id": tokenizer.eos_token_id}
        config = AutoConfig.for_model(**values)
        torch.manual_seed(0 if name == "student" else 1)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        paths[name] = root / name
        model.save_pretrained(paths[name])
        tokenizer.save_pretrained(paths[name])
        del model
    return paths


def run_config(paths: dict, root: Path, args, **training) -> dict:
    prompts = root / "prompts.jsonl"
    if not prompts.exists():
        words = [
            "".join(chr(97 + (i * 7 + j * 3) % 26) for j in range(3 + i % 5)) for i in range(64)
        ]
        prompts.write_text(
            "".join(json.dumps({"prompt": f"reverse {w}", "answer": w[::-1]}) + "\n" for w in words)
        )
    model = {"device": args.device, "dtype": args.dtype}
    return {
        "log_path": str(root / "run"),
        "seed": 0,
        "eval_every": 0,
        "save_every": 0,
        "student": {"model": str(paths["student"]), "lora_rank": 0, **model},
        "teacher": {"model": str(paths["teacher"]), **model},
        "datasets": [
            {"name": "rev", "source": str(prompts), "groups_per_batch": 4, "group_size": 2}
        ],
        "training": {"max_tokens": 16 if args.tiny else 64, "max_steps": 10, **training},
    }


def rows_batch(rows: int, length: int, prompt: int, vocab: int):
    """``rows`` rows of ``length`` tokens, the last ``length - prompt`` of them trained."""
    import torch

    from opd.data.sequences import RolloutBatch

    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (rows, length), generator=generator)
    mask = torch.zeros(rows, length)
    mask[:, prompt:] = 1.0
    return RolloutBatch(
        ids,
        torch.ones(rows, length, dtype=torch.long),
        mask,
        torch.full((rows, length), -2.0) * mask,
        torch.zeros(rows, dtype=torch.long),
        torch.ones(rows, dtype=torch.bool),
        [prompt] * rows,
    )


def synchronize(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def check_packing(trainer, args) -> dict:
    import torch

    from opd.logprobs.forward import backbone_and_head

    teacher = trainer.parts.teachers.per_dataset[0]
    batch = rows_batch(8, 48 if args.tiny else 512, 16, len(trainer.parts.tokenizer))
    lengths = (
        [12, 48, 20, 33, 48, 5, 40, 27] if args.tiny else [64, 512, 200, 333, 480, 96, 410, 270]
    )
    for row, length in enumerate(lengths):
        batch.attention_mask_BT[row, length:] = 0
        batch.mask_BT[row, length:] = 0
    scored, seconds, seen, paths = {}, {}, {}, {}
    tokens = []  # what each forward of the teacher's model was given, padding included
    backbone, _ = backbone_and_head(teacher.model)
    hook = backbone.register_forward_pre_hook(
        lambda module, args, kwargs: tokens.append(kwargs["input_ids"].numel()), with_kwargs=True
    )
    try:
        for packed in (True, False):
            teacher.set_packing(packed)
            paths[packed] = teacher.module.packed
            tokens.clear()
            synchronize(teacher.device)
            started = time.perf_counter()
            scored[packed] = trainer.parts.teachers.score(batch).logprobs_BT
            synchronize(teacher.device)
            seconds[packed], seen[packed] = time.perf_counter() - started, sum(tokens)
    finally:
        hook.remove()
        teacher.set_packing(True)
    where = batch.mask_BT.bool()
    difference = float((scored[True][where] - scored[False][where]).abs().max())
    model = teacher.model
    attention = getattr(model.config, "_attn_implementation", None)
    kernels = {}
    if torch.cuda.is_available():
        kernels = {
            "flash_sdp": torch.backends.cuda.flash_sdp_enabled(),
            "mem_efficient_sdp": torch.backends.cuda.mem_efficient_sdp_enabled(),
        }
    tolerance = 1e-4 if args.dtype == "float32" else BF16_TOLERANCE
    return {
        "max_abs_difference": difference,
        "tolerance": tolerance,
        "equal": difference <= tolerance,
        "attention": attention,
        "packed_path": "one sdpa call per sequence (opd.packing)",
        "packed": paths[True],
        "padded": not paths[False],
        "packed_seconds": seconds[True],
        "padded_seconds": seconds[False],
        "packed_forward_tokens": seen[True],
        "padded_forward_tokens": seen[False],
        "tokens": sum(lengths),
        "sdpa_backends_enabled": kernels,
    }


def check_update(trainer_for, args, flops_peak) -> list[dict]:
    import torch

    from opd.assemble.micro_batching import activation_bytes_per_token
    from opd.trainer.update import policy_gradient, policy_update

    results = []
    rows, length = (8, 48) if args.tiny else (32, 512)
    budgets = [96, 384] if args.tiny else [2048, 8192, 16384]
    for checkpointing in (False, True):
        trainer = trainer_for(checkpointing)
        device = trainer.parts.policy.device
        parameters = sum(p.numel() for p in trainer.parts.policy.model.parameters())
        batch = rows_batch(rows, length, 16, len(trainer.parts.tokenizer))
        scores = trainer.parts.teachers.score(batch)
        advantages = trainer.parts.objective.advantages(
            batch.sampled_logprobs_BT,
            scores,
            batch.mask_BT,
            policy_gradient(trainer.parts.config.training),
        )
        advantages = torch.zeros_like(batch.mask_BT) if advantages is None else advantages
        static = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        per_token = activation_bytes_per_token(
            trainer.parts.policy.base_model.config,
            2 if args.dtype != "float32" else 4,
            False,
            checkpointing,
        )
        for budget in budgets:
            batching = dataclasses.replace(trainer.parts.batching, tokens=budget)
            timings = []
            for _ in range(3):  # the first warms up
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(device)
                synchronize(device)
                started = time.perf_counter()
                policy_update(
                    trainer.parts.policy,
                    trainer.parts.objective,
                    trainer.parts.optimizer,
                    trainer.parts.scheduler,
                    batch,
                    scores,
                    advantages,
                    trainer.parts.config.training,
                    batching,
                )
                synchronize(device)
                timings.append(time.perf_counter() - started)
            seconds = min(timings[1:])
            tokens = int(batch.attention_mask_BT.sum())
            peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
            flops = 6 * parameters * tokens / seconds
            results.append(
                {
                    "gradient_checkpointing": checkpointing,
                    "micro_batch_tokens": budget,
                    "tokens": tokens,
                    "seconds": seconds,
                    "tokens_per_s": tokens / seconds,
                    "mfu": flops / flops_peak if flops_peak else None,
                    "peak_bytes": peak,
                    "estimate_bytes": static + per_token * budget,
                    "peak_over_estimate": peak / (static + per_token * budget) if peak else None,
                }
            )
        del trainer
    return results


def check_sampler(trainer, args, bandwidth) -> list[dict]:
    from opd.sampling.hf_generate import HFGenerateSampler

    model = trainer.parts.policy.model
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    sampler = HFGenerateSampler(
        model, trainer.parts.tokenizer, stop_token_ids=[-1]
    )  # no stop: every row runs to the end
    prompt = trainer.parts.renderer.prompt_ids(({"role": "user", "content": "reverse abcdef"},))
    new_tokens = 16 if args.tiny else 128
    results = []
    for batch in (4, 8) if args.tiny else (64, 256):
        sampler.sample([prompt] * batch, temperature=1.0, max_tokens=4, seed=0)  # warm-up
        synchronize(trainer.parts.policy.device)
        started = time.perf_counter()
        completions = sampler.sample(
            [prompt] * batch, temperature=1.0, max_tokens=new_tokens, seed=0
        )
        synchronize(trainer.parts.policy.device)
        seconds = time.perf_counter() - started
        tokens = sum(len(c.token_ids) for c in completions)
        floor = batch * bandwidth / weight_bytes if bandwidth else None
        results.append(
            {
                "batch": batch,
                "tokens": tokens,
                "tokens_per_s": tokens / seconds,
                "bandwidth_floor_tokens_per_s": floor,
                "share_of_floor": tokens / seconds / floor if floor else None,
            }
        )
    return results


def check_teacher(trainer, args) -> dict:
    batch = rows_batch(
        8 if args.tiny else 64, 48 if args.tiny else 512, 16, len(trainer.parts.tokenizer)
    )
    trainer.parts.teachers.score(batch)  # warm-up
    synchronize(trainer.parts.policy.device)
    started = time.perf_counter()
    trainer.parts.teachers.score(batch)
    synchronize(trainer.parts.policy.device)
    seconds = time.perf_counter() - started
    tokens = int(batch.attention_mask_BT.sum())
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds}


def check_resume(paths: dict, root: Path, args) -> dict:
    """Uninterrupted, then SIGKILL after 5 rows and the same command: row by row."""
    import yaml

    from opd.runs.metrics import read_jsonl

    tolerance = 1e-6 if args.dtype == "float32" else 1e-2
    runs = {}
    for name in ("reference", "killed"):
        config = run_config(paths, root, args, max_steps=10) | {
            "log_path": str(root / name),
            "save_every": 3,
        }
        path = root / f"{name}.yaml"
        path.write_text(yaml.safe_dump(config))
        runs[name] = path
    command = [sys.executable, "-m", "opd", "train"]
    environment = os.environ | {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    subprocess.run(
        [*command, str(runs["reference"]), "--no-progress"],
        check=True,
        env=environment,
        capture_output=True,
    )
    metrics = root / "killed" / "metrics.jsonl"
    job = subprocess.Popen(
        [*command, str(runs["killed"]), "--no-progress"],
        env=environment,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and job.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 5:
            break
        time.sleep(0.01)
    killed_at = len(metrics.read_text().splitlines()) if metrics.exists() else 0
    job.send_signal(signal.SIGKILL)
    job.wait()
    subprocess.run(
        [*command, str(runs["killed"]), "--no-progress"],
        check=True,
        env=environment,
        capture_output=True,
    )
    reference, resumed = read_jsonl(root / "reference" / "metrics.jsonl"), read_jsonl(metrics)
    keys = ("teacher_kl", "loss", "grad_norm")
    worst = max(
        abs(a[k] - b[k]) for a, b in zip(reference, resumed, strict=True) for k in keys if k in a
    )
    kl = max(abs(r["kl_sample_train"]) for r in reference if "kl_sample_train" in r)
    return {
        "killed_after_rows": killed_at,
        "steps": len(resumed),
        "max_abs_difference": worst,
        "tolerance": tolerance,
        "equal": len(resumed) == len(reference) and worst <= tolerance,
        "max_abs_kl_sample_train": kl,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--cpu", action="store_true", help="run on the CPU (float32)")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes: every section in seconds")
    parser.add_argument(
        "--budget-s", type=float, default=420, help="skip sections not started by then"
    )
    parser.add_argument(
        "--out", type=Path, help="also write the results here as JSON, with their provenance"
    )
    args = parser.parse_args()
    import torch

    if not args.cpu and not torch.cuda.is_available():
        raise SystemExit("gpu_check: no CUDA device; --cpu --tiny runs every section on the CPU")
    args.device, args.dtype = ("cpu", "float32") if args.cpu else ("cuda", "bfloat16")
    device = torch.device(args.device)
    flops_peak, bandwidth = peaks(device)
    started = time.perf_counter()
    results: dict = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": args.dtype,
        "peak_flops": flops_peak,
        "peak_bandwidth": bandwidth,
    }
    from opd.config import config_from_dict
    from opd.trainer.loop import Trainer

    with tempfile.TemporaryDirectory() as directory:
        root = Path(directory)
        paths = build_models(root, args.tiny, device, getattr(torch, args.dtype))
        results["build_seconds"] = time.perf_counter() - started

        def trainer_for(checkpointing: bool = False) -> Trainer:
            config = run_config(paths, root, args)
            config["student"]["gradient_checkpointing"] = checkpointing
            return Trainer(config_from_dict(config), progress=False)

        shared: dict = {}

        def trainer() -> Trainer:
            if "trainer" not in shared:
                shared["trainer"] = trainer_for()
            return shared["trainer"]

        sections = {
            "packing": lambda: check_packing(trainer(), args),
            "teacher": lambda: check_teacher(trainer(), args),
            "sampler": lambda: check_sampler(trainer(), args, bandwidth),
            "update": lambda: (shared.clear(), check_update(trainer_for, args, flops_peak))[1],
            "resume": lambda: check_resume(paths, root, args),
        }
        for name, section in sections.items():
            if time.perf_counter() - started > args.budget_s:
                results[name] = {"skipped": f"past --budget-s {args.budget_s:g}"}
                continue
            began = time.perf_counter()
            try:
                results[name] = section()
            except Exception as error:  # one section's failure must not cost the others' figures
                results[name] = {"error": f"{type(error).__name__}: {error}"[:500]}
            print(
                f"{name}: {time.perf_counter() - began:.1f} s  {json.dumps(results[name])[:300]}",
                flush=True,
            )
    results["seconds"] = time.perf_counter() - started
    print(json.dumps(results, indent=1))
    write_result(args.out, "bench/gpu_check.py", vars(args), results)
    failed = [name for name in sections if "error" in results[name] or results[name] is False]
    if failed:
        raise SystemExit(f"gpu_check: sections failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
