"""How much greedy accuracy does a student lose per nat of KL from its teacher? A noisy-copy probe.

`bench/sample_efficiency.py` scores students greedily on 48 held-out prompts, and on the
multi-step task every method plateaued at 70-79% against the teacher's 90% while its teacher KL
(per token, on its own samples) was 0.02-0.03. This asks what such a KL costs, with no training:
the cached teacher decodes greedily with Gaussian noise (std ``sigma``) added to its logits at
every step, a near-copy whose KL to the teacher is measured along its own path, and is scored with
the task's scorer. Also printed: the teacher's accuracy when sampled at temperature 1 (what SFT on
fresh teacher samples imitates), and how many greedy paths pass a near-tie between two tokens.

    python bench/sample_efficiency.py --tasks multistep --methods sft --steps 1   # builds the teacher once
    python bench/greedy_fragility.py
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch
import yaml
from provenance import write_result
from sample_efficiency import SWEEP, cache_root, float32_sampler, task_files
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList

from opd.data.graders import GRADERS
from opd.data.sources import load_prompts


class LogitNoise(LogitsProcessor):
    """Adds ``sigma`` x N(0, 1) to each step's logits; keeps KL(noisy || teacher) and the top-2 gap."""

    def __init__(self, sigma: float, seed: int, vocab_size: int):
        self.sigma, self.vocab_size = sigma, vocab_size
        self.generator = torch.Generator().manual_seed(seed)
        self.kl_steps: list[torch.Tensor] = []
        self.top2_gap_steps: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        logits_BV = scores[:, : self.vocab_size].float()
        noisy_BV = logits_BV + self.sigma * torch.randn(logits_BV.shape, generator=self.generator)
        teacher_BV, student_BV = logits_BV.log_softmax(-1), noisy_BV.log_softmax(-1)
        self.kl_steps.append((student_BV.exp() * (student_BV - teacher_BV)).sum(-1))
        top2_B2 = teacher_BV.exp().topk(2, dim=-1).values
        self.top2_gap_steps.append(top2_B2[:, 0] - top2_B2[:, 1])
        out = torch.full_like(scores, -float("inf"))
        out[:, : self.vocab_size] = noisy_BV
        return out


def noisy_greedy(model, tokenizer, renderer, prompts, sigma: float, seed: int, max_tokens: int) -> dict:
    """Greedy decoding under logit noise: grades, KL per token and each path's smallest top-2 gap."""
    rendered = [renderer.prompt_ids(p.messages) for p in prompts]
    stop_ids = renderer.stop_token_ids
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stop_ids[0]
    width = max(map(len, rendered))
    input_ids = torch.full((len(rendered), width), pad_id)
    attention_mask = torch.zeros_like(input_ids)
    for row, ids in enumerate(rendered):
        input_ids[row, width - len(ids) :] = torch.tensor(ids)
        attention_mask[row, width - len(ids) :] = 1
    noise = LogitNoise(sigma, seed, len(tokenizer))
    defaults, model.generation_config = model.generation_config, GenerationConfig()
    try:
        with torch.no_grad():
            sequences = model.generate(
                input_ids=input_ids,
                attention_mask=attention_mask,
                generation_config=GenerationConfig(
                    do_sample=False, max_new_tokens=max_tokens, eos_token_id=stop_ids, pad_token_id=pad_id
                ),
                logits_processor=LogitsProcessorList([noise]),
            )
    finally:
        model.generation_config = defaults
    generated_BT = sequences[:, width:]
    steps = generated_BT.shape[1]
    live_BT = torch.ones(generated_BT.shape, dtype=torch.bool)  # up to and including the first stop token
    for row, ids in enumerate(generated_BT.tolist()):
        end = next((i for i, token in enumerate(ids) if token in stop_ids), steps - 1)
        live_BT[row, end + 1 :] = False
    kl_BT = torch.stack(noise.kl_steps, 1)[:, :steps]
    gap_BT = torch.stack(noise.top2_gap_steps, 1)[:, :steps]
    grade = GRADERS["reasoning_gym"]
    texts = [
        tokenizer.decode(generated_BT[row][live_BT[row]].tolist(), skip_special_tokens=True)
        for row in range(len(prompts))
    ]
    return {
        "grades": [grade(text, prompt) for text, prompt in zip(texts, prompts, strict=True)],
        "kl_per_token": (kl_BT * live_BT).sum().item() / live_BT.sum().item(),
        "smallest_gap": gap_BT.masked_fill(~live_BT, 2.0).min(1).values.tolist(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    tasks = yaml.safe_load(SWEEP.read_text())["tasks"]
    parser.add_argument("--task", default="multistep", choices=list(tasks))
    parser.add_argument("--sigmas", type=float, nargs="*", default=[0.25, 0.5, 1.0, 2.0, 3.0])
    parser.add_argument("--seeds", type=int, default=3, help="noise draws per sigma")
    parser.add_argument("--samples", type=int, default=8, help="temperature-1 samples per prompt")
    parser.add_argument("--out", type=Path, help="also write the results here as JSON, with their provenance")
    args = parser.parse_args()

    teacher = cache_root() / f"teacher-{args.task}"
    if not (teacher / "teacher.json").exists():
        parser.error(f"no cached teacher at {teacher}: build it with bench/sample_efficiency.py first")
    spec = tasks[args.task]
    max_tokens = spec["max_tokens"]
    model, tokenizer, renderer, sampler = float32_sampler(teacher)
    model.eval()
    prompts = load_prompts(str(task_files(args.task, spec)[1]))

    exact = noisy_greedy(model, tokenizer, renderer, prompts, 0.0, 0, max_tokens)
    print(f"teacher {teacher}, {len(prompts)} held-out prompts")
    print(f"greedy: {statistics.mean(exact['grades']):.3f}")
    for gap in (0.1, 0.2, 0.5):
        pairs = zip(exact["grades"], exact["smallest_gap"], strict=True)
        near = [grade for grade, smallest in pairs if smallest < gap]
        right = f", {statistics.mean(near):.3f} of them right" if near else ""
        print(f"greedy paths through a top-1 minus top-2 probability gap < {gap}: {len(near)}{right}")
    rendered = [renderer.prompt_ids(p.messages) for p in prompts]
    completions = sampler.sample(rendered * args.samples, temperature=1.0, max_tokens=max_tokens, seed=0)
    grades = [
        GRADERS["reasoning_gym"](tokenizer.decode(c.token_ids, skip_special_tokens=True), p)
        for c, p in zip(completions, prompts * args.samples, strict=True)
    ]
    per_prompt = [statistics.mean(grades[i :: len(prompts)]) for i in range(len(prompts))]
    print(
        f"sampled at temperature 1 ({args.samples} per prompt): {statistics.mean(grades):.3f}; "
        f"prompts always right {sum(p == 1 for p in per_prompt)}, "
        f"sometimes {sum(0 < p < 1 for p in per_prompt)}, never {sum(p == 0 for p in per_prompt)}"
    )
    print(f"{'sigma':>6} {'KL/token':>9} {'greedy accuracy per seed':>26} {'mean':>6}")
    noisy = []
    for sigma in args.sigmas:
        runs = [
            noisy_greedy(model, tokenizer, renderer, prompts, sigma, seed, max_tokens)
            for seed in range(1, args.seeds + 1)
        ]
        accuracies = [statistics.mean(r["grades"]) for r in runs]
        kl = statistics.mean(r["kl_per_token"] for r in runs)
        print(
            f"{sigma:6.2f} {kl:9.4f} {' / '.join(f'{a:.3f}' for a in accuracies):>26} "
            f"{statistics.mean(accuracies):6.3f}"
        )
        noisy.append({"sigma": sigma, "kl_per_token": kl, "accuracies": accuracies})
    results = {
        "teacher_greedy_accuracy": statistics.mean(exact["grades"]),
        "teacher_sampled_accuracy": statistics.mean(grades),
        "prompts": len(prompts),
        "noisy_greedy": noisy,
    }
    write_result(args.out, "bench/greedy_fragility.py", vars(args) | {"teacher": str(teacher)}, results)


if __name__ == "__main__":
    main()
