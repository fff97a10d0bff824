"""Is opd's sampler at its floor? ``generate`` vs a bare cached decode loop vs the matmuls alone.

At a small batch on a CPU, one decode step reads every weight once and does little arithmetic
with each, so reading the weights is most of the step's time. For
``--batch`` rows this prints the seconds per decoded token of:

- with ``--vllm``, opd's ``VLLMEngine`` (an in-process ``vllm.LLM``, the same float32 weights);
- opd's ``HFGenerateSampler`` (HF ``generate``, KV cache, log-prob recorder, stop checks);
- a hand-written loop of cached forward calls with opd's inverse-CDF draw and nothing else;
- the floor: one matmul per linear layer of the model (lm head included) at the same batch,
  i.e. reading the weights once, without attention, norms or Python;

and the ratios to the floor. When the first two sit close to the floor, a faster sampler
written around the same model in the same precision has little left to win.

``--update-tokens T`` also times the update's floor: each linear layer's three matmuls of a
forward and backward pass (``x @ W.T``, ``dy @ W``, ``dy.T @ x``) over T tokens (a step's
prompt and completion tokens), lm head included, without attention, norms or the optimizer;
6 x linear parameters x T flops, at the rate this machine's matmuls reach. With
``--update-objective`` it times opd's own update at those tokens in the same run, and profiles
one to say what lies outside the matmuls.

    python bench/sampler_floor.py --model ~/.cache/opd/smollm2-135m-instruct
    python bench/sampler_floor.py --model ~/.cache/opd/smollm2-135m-instruct --update-tokens 1924
    python bench/sampler_floor.py --model ~/.cache/opd/smollm2-135m-instruct --update-tokens 1924 \
        --update-objective jsd
"""

from __future__ import annotations

import argparse
import inspect
import statistics
import time
from pathlib import Path

import torch
from provenance import write_result
from torch import nn


def per_token_seconds(run, tokens: int, repeats: int) -> float:
    """Median seconds of ``run()`` over ``repeats`` calls (after one warm-up), per decoded token."""
    run()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return statistics.median(times) / tokens


def vllm_engine(model_dir: str, model, tokenizer, *, stop_token_ids: list[int]):
    """opd's vLLM rollout engine of ``model`` (float32, as the other rows), synced once."""
    from opd.policy import Policy, StudentConfig
    from opd.sampling.vllm_engine import VLLMEngine

    policy = Policy(model, len(tokenizer))
    student = StudentConfig(model=model_dir, lora_rank=0, sampler="vllm", dtype="float32")
    engine = VLLMEngine(student, policy, tokenizer, stop_token_ids=stop_token_ids)
    engine.sync(policy)
    return engine


def update_floor(linears: list[nn.Linear], tokens: int, repeats: int) -> dict:
    """Median seconds of every linear layer's forward and backward matmuls over ``tokens``
    tokens."""
    generator = torch.Generator().manual_seed(0)
    inputs = [torch.randn(tokens, m.in_features, generator=generator) for m in linears]
    grads = [torch.randn(tokens, m.out_features, generator=generator) for m in linears]

    @torch.inference_mode()
    def matmuls() -> None:
        for linear, x, dy in zip(linears, inputs, grads, strict=True):
            x @ linear.weight.T
            dy @ linear.weight
            dy.T @ x

    seconds = per_token_seconds(matmuls, 1, repeats)
    flop = sum(6 * tokens * m.in_features * m.out_features for m in linears)
    return {"tokens": tokens, "seconds": seconds, "flop": flop, "gflop_per_s": flop / seconds / 1e9}


MATMULS = ("aten::mm", "aten::addmm", "aten::addmm_", "aten::bmm")
"""The ops that do the floor's work (and the fused heads' own projections); the rest of the
update's profile lies outside it."""


def opd_update(model_dir: str, tokens: int, rows: int, objective: str, repeats: int) -> dict:
    """opd's update (forward, backward, optimizer step) of ``rows`` rows over ``tokens`` tokens,
    a seventh of each row its prompt as in the long step, the model its own teacher (full
    fine-tuning, float32, the micro-batches opd sizes); its median seconds, and where one
    profiled update spends them, by torch op (self time, so the ops add up to the whole)."""
    import json
    import tempfile

    from gpu_check import rows_batch
    from torch.profiler import ProfilerActivity, profile

    from opd.assemble.run import assemble_run
    from opd.config import config_from_dict
    from opd.trainer.update import policy_gradient, policy_update

    with tempfile.TemporaryDirectory() as directory:
        prompts = Path(directory) / "prompts.jsonl"
        prompts.write_text((json.dumps({"prompt": "Say hello."}) + "\n") * rows)
        options = {"beta": 1.0} if objective == "jsd" else {}  # TRL's objective, as step_time's
        config = {
            "log_path": str(Path(directory) / "run"),
            "student": {"model": model_dir, "lora_rank": 0, "device": "cpu"},
            "teacher": {"model": model_dir, "device": "cpu"},
            "datasets": [
                {
                    "name": "update",
                    "source": str(prompts),
                    "groups_per_batch": rows,
                    "group_size": 1,
                }
            ],
            "training": {"objective": {"name": objective, **options}, "learning_rate": 1e-5},
        }
        parts = assemble_run(config_from_dict(config))
    length = tokens // rows
    batch = rows_batch(rows, length, length // 7, len(parts.tokenizer))
    scores = parts.teachers.score(batch)
    training = parts.config.training
    advantages = parts.objective.advantages(
        batch.sampled_logprobs_BT, scores, batch.mask_BT, policy_gradient(training)
    )
    advantages = torch.zeros_like(batch.mask_BT) if advantages is None else advantages

    def update() -> None:
        policy_update(
            parts.policy, parts.objective, parts.optimizer, parts.scheduler, batch, scores,
            advantages, training, parts.batching,
        )  # fmt: skip

    seconds = per_token_seconds(update, 1, repeats)
    with profile(activities=[ProfilerActivity.CPU]) as profiled:
        update()
    ops = {e.key: e.self_cpu_time_total / 1e6 for e in profiled.key_averages()}
    total = sum(ops.values())
    top = sorted(ops.items(), key=lambda op: -op[1])[:12]
    return {
        "tokens": rows * length,
        "rows": rows,
        "micro_batch_tokens": parts.batching.tokens,
        "seconds": seconds,
        "profiled_seconds": total,
        "matmul_share": sum(ops.get(name, 0.0) for name in MATMULS) / total,
        "attention_share": sum(t for name, t in ops.items() if "scaled_dot_product" in name)
        / total,
        "top_ops_share": {name: t / total for name, t in top},
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", required=True, help="a local Hugging Face causal LM directory")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=40)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--vllm", action="store_true", help="also time opd's vLLM engine (needs vLLM)"
    )
    parser.add_argument(
        "--update-tokens", type=int, help="also time the update's matmuls at T tokens"
    )
    parser.add_argument(
        "--update-objective",
        help="with --update-tokens: also time opd's own update at those tokens beside its floor "
        "(8 rows), with this objective, and profile it",
    )
    parser.add_argument(
        "--out", type=Path, help="also write the results here as JSON, with their provenance"
    )
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

    from opd.sampling.hf_generate import HFGenerateSampler
    from opd.sampling.seeded import inverse_cdf_sample

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(0)
    vocab = len(tokenizer)
    prompt_ids = torch.randint(0, vocab, (args.batch, args.prompt_tokens), generator=generator)
    # No stop id can end a row early: every row decodes exactly --new-tokens tokens.
    sampler = HFGenerateSampler(model, tokenizer, stop_token_ids=[vocab + 1])
    prompts = prompt_ids.tolist()

    def opd_sampler() -> None:
        sampler.sample(prompts, temperature=1.0, max_tokens=args.new_tokens)

    # transformers 5.x renamed `past_key_values` to `cache` (the old name still works, with a
    # warning)
    cache_argument = (
        "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    )

    @torch.inference_mode()
    def bare_loop() -> None:
        attention = torch.ones_like(prompt_ids)
        cache = {cache_argument: DynamicCache()}
        logits = model(input_ids=prompt_ids, attention_mask=attention, **cache).logits
        for _ in range(args.new_tokens - 1):
            probs = torch.softmax(logits[:, -1].float(), dim=-1)
            token = inverse_cdf_sample(probs, torch.rand(probs.shape[0]))[:, None]
            attention = torch.cat([attention, torch.ones_like(token)], dim=1)
            logits = model(input_ids=token, attention_mask=attention, **cache).logits

    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    inputs = [torch.randn(args.batch, m.in_features) for m in linears]

    @torch.inference_mode()
    def weights_read() -> None:
        for linear, x in zip(linears, inputs, strict=True):
            x @ linear.weight.T

    @torch.inference_mode()
    def prefill() -> None:
        model(input_ids=prompt_ids, attention_mask=torch.ones_like(prompt_ids), logits_to_keep=1)

    weight_bytes = sum(m.weight.numel() * m.weight.element_size() for m in linears)
    floor = per_token_seconds(weights_read, 1, args.repeats * 5)
    rows = {}
    if args.vllm:
        engine = vllm_engine(args.model, model, tokenizer, stop_token_ids=[])  # never stops early
        rows["opd VLLMEngine"] = per_token_seconds(
            lambda: engine.sample(prompts, temperature=1.0, max_tokens=args.new_tokens, seed=0),
            args.new_tokens,
            args.repeats,
        )
    rows |= {
        "opd HFGenerateSampler": per_token_seconds(opd_sampler, args.new_tokens, args.repeats),
        "bare cached decode loop": per_token_seconds(bare_loop, args.new_tokens, args.repeats),
        "matmuls alone (floor)": floor,
    }
    print(
        f"{args.model}: batch {args.batch}, {args.prompt_tokens} prompt + {args.new_tokens} new "
        f"tokens, {torch.get_num_threads()} threads; linear weights {weight_bytes / 2**20:.0f} MiB "
        f"float32, read at {weight_bytes / floor / 2**30:.1f} GiB/s by the floor"
    )
    print(
        "the two decoders' times include the prompt's prefill: one forward, "
        f"{per_token_seconds(prefill, 1, args.repeats) * 1000:.0f} ms"
    )
    print(f"{'':>24} {'ms/token':>9} {'vs floor':>9}")
    # (vLLM's time includes its prefill too)
    for name, seconds in rows.items():
        print(f"{name:>24} {seconds * 1000:9.1f} {seconds / floor:9.2f}")
    results = {
        "ms_per_token": {name: 1000 * s for name, s in rows.items()},
        "weights_mib": weight_bytes / 2**20,
    }
    if args.update_tokens:
        results["update_floor"] = update_floor(linears, args.update_tokens, args.repeats)
        floor = results["update_floor"]
        print(
            f"the update's matmuls at {args.update_tokens} tokens: {floor['seconds']:.2f} s "
            f"({floor['flop'] / 1e12:.2f} Tflop at {floor['gflop_per_s']:.0f} Gflop/s)"
        )
    if args.update_tokens and args.update_objective:
        update = opd_update(
            args.model, args.update_tokens, args.batch, args.update_objective, args.repeats
        )
        update["vs_floor"] = update["seconds"] / floor["seconds"]
        results["update"] = update
        print(
            f"opd's update ({args.update_objective}) at {update['tokens']} tokens: "
            f"{update['seconds']:.2f} s, {update['vs_floor']:.2f}x the floor; in one profiled "
            f"update the matmuls take {update['matmul_share']:.1%}, attention "
            f"{update['attention_share']:.1%}; the ops taking most:"
        )
        for name, share in update["top_ops_share"].items():
            print(f"{name:>48} {share:6.1%}")
    write_result(args.out, "bench/sampler_floor.py", vars(args), results)


if __name__ == "__main__":
    main()
