"""Does the vLLM engine sample from the weights being trained? ``kl_sample_train`` over real runs.

Each run trains SmolLM2-135M-Instruct (full fine-tune, and LoRA rank 16 with each
``student.lora_sync``) for ``--steps`` steps with ``student.sampler: vllm`` at a learning rate
that moves the weights, and records per step: ``kl_sample_train`` (vLLM's recorded log-probs
against the trainer's own on the same tokens: ~0 when the engine holds the trained weights),
``post_kl`` (how far the step's update moved the policy on its batch: what a stale engine would
show), and the seconds of the weight sync and of sampling. The teacher is the same model with
its weights perturbed (a teacher that disagrees, so that the updates are not zero); prompts are
reasoning-gym ``chain_sum``.

    python bench/smollm2.py      # once: the converted model
    python bench/vllm_sync.py --out docs/results/vllm_sync.json
    # the sampler in bfloat16 against a float32 trainer: the mismatch rollout_correction bounds
    python bench/vllm_sync.py --runs full --sampling-dtype bfloat16 --objective sampled_reverse_kl
    # on a GPU: colocated, bfloat16, the engine asleep during the update
    python bench/vllm_sync.py --device cuda --dtype bfloat16 --sampler-options
    '{"enable_sleep_mode": true}'
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import torch
from provenance import write_result
from smollm2 import converted_dir

RUNS = {
    "full": {"lora_rank": 0, "learning_rate": 1e-4},
    "lora-merged": {"lora_rank": 16, "lora_sync": "merged", "learning_rate": 1e-3},
    "lora-adapter": {"lora_rank": 16, "lora_sync": "adapter", "learning_rate": 1e-3},
}


def perturbed_teacher(model_dir: Path, noise: float) -> Path:
    """``model_dir`` with Gaussian noise of ``noise`` times each weight's std added, cached beside
    it."""
    target = model_dir.with_name(f"{model_dir.name}-perturbed-{noise}")
    if (target / "config.json").exists():
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(
                torch.randn(parameter.shape, generator=generator) * parameter.std() * noise
            )
    staging = target.with_name(target.name + ".tmp")
    model.save_pretrained(staging)
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(staging)
    staging.replace(target)
    return target


def run(name: str, student: Path, teacher: Path, args) -> tuple[list[dict], dict]:
    """The run's per-step records, and its resolved opd config."""
    from opd.config import config_from_dict, config_to_dict
    from opd.trainer.loop import train

    settings = dict(RUNS[name])
    learning_rate = settings.pop("learning_rate")
    with tempfile.TemporaryDirectory() as directory:
        config = {
            "log_path": str(Path(directory) / "run"),
            "seed": args.seed,
            "eval_every": 0,
            "save_every": 0,
            "compute_post_kl": True,
            "student": {
                "model": str(student),
                "dtype": args.dtype,
                "device": args.device,
                "sampler": "vllm",
                "sampling_dtype": args.sampling_dtype,
                "sampler_options": args.sampler_options,
                **settings,
            },
            "teacher": {"model": str(teacher), "dtype": args.dtype, "device": args.device},
            "datasets": [
                {
                    "name": "chain_sum",
                    "source": "reasoning_gym:chain_sum",
                    "task_config": {
                        "min_terms": 2,
                        "max_terms": 2,
                        "min_digits": 1,
                        "max_digits": 1,
                    },
                    "groups_per_batch": args.prompts,
                    "group_size": args.group_size,
                }
            ],
            "training": {
                "learning_rate": learning_rate,
                "max_tokens": args.max_tokens,
                "max_steps": args.steps,
                **({"objective": args.objective} if args.objective else {}),
            },
        }
        resolved = config_from_dict(config)
        metrics = train(resolved, progress=False).metrics
    keys = (
        "kl_sample_train",
        "post_kl",
        "teacher_kl",
        "time/weight_sync",
        "time/sample",
        "time/total",
    )
    return [
        {"step": m["step"], **{k: m[k] for k in keys}}
        | {k: v for k, v in m.items() if k.startswith("rollout_correction/")}
        for m in metrics
    ], config_to_dict(resolved)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument(
        "--noise", type=float, default=0.05, help="the teacher's perturbation (x weight std)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--runs", nargs="*", default=list(RUNS), choices=list(RUNS))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument(
        "--sampling-dtype",
        choices=["float32", "bfloat16"],
        help="student.sampling_dtype: vLLM samples in it while the trainer keeps --dtype",
    )
    parser.add_argument("--objective", help="training.objective (default: opd's)")
    parser.add_argument(
        "--sampler-options", type=json.loads, default={}, help="student.sampler_options as JSON"
    )
    parser.add_argument(
        "--out", type=Path, help="also write the results here as JSON, with their provenance"
    )
    args = parser.parse_args()
    student = converted_dir()
    teacher = perturbed_teacher(student, args.noise)
    results, configs = {}, {}
    print(
        f"{'run':>13} {'max |kl_sample_train|':>22} {'min post_kl':>12} {'sync s':>7} "
        f"{'sample s':>9} {'step s':>7}"
    )
    for name in args.runs:
        rows, configs[name] = run(name, student, teacher, args)
        results[name] = rows
        timed = rows[
            1:
        ]  # the first step builds nothing, but pays the first sync of the whole model
        print(
            f"{name:>13} {max(abs(r['kl_sample_train']) for r in rows):22.2e} "
            f"{min(r['post_kl'] for r in rows):12.2e} "
            f"{statistics.median(r['time/weight_sync'] for r in timed):7.3f} "
            f"{statistics.median(r['time/sample'] for r in timed):9.3f} "
            f"{statistics.median(r['time/total'] for r in timed):7.3f}"
        )
    write_result(args.out, "bench/vllm_sync.py", vars(args) | {"configs": configs}, results)


if __name__ == "__main__":
    main()
