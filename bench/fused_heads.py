"""Time and peak memory of the fused divergence heads, forward + backward: fused vs autograd vs
naive.

Two objectives: ``jsd`` (against a teacher head, ``--beta``) and ``topk`` (``topk_forward_kl``
against a teacher's ``--topk`` ids and log-probs, drawn once from a random teacher head and not
timed: in training they come from the teacher panel or a server).

- ``naive``: the student's full (N, V) logits, the divergence (``generalized_jsd`` or
  ``topk_forward_kl`` of ``tests/reference.py``), autograd.
- ``checkpointed``: ``chunked_head_objective`` (``tests/reference.py``) with the same divergence
  per chunk (autograd inside activation checkpointing; what opd ran before the fused heads).
- ``fused``: ``opd.objectives.jsd_head.chunked_jsd`` or
``opd.objectives.topk_head.chunked_topk_forward_kl``
  (in place, analytic gradient).

Each variant runs in its own process (peak = the rise of its high-water mark over the inputs
it holds); inside it, one warm-up call and then ``--calls`` timed ones (median). The student
head is trained (full fine-tuning), the teacher's is frozen. Ratios are against ``naive``.

    python bench/fused_heads.py                    # N=256 rows (8 x 32 tokens), D=576, V=49152
    python bench/fused_heads.py --objective jsd --rows 2048 --beta 0 1 0.5
    python bench/fused_heads.py --objective topk --topk 32 64
"""

from __future__ import annotations

import argparse
import functools
import json
import resource
import statistics
import sys
import time
from pathlib import Path

import torch
from isolated_runs import alternating_medians, run_child
from provenance import write_result

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the references live in tests/
VARIANTS = ("naive", "checkpointed", "fused")
OBJECTIVES = ("jsd", "topk")


def loss_function(variant: str, objective: str, setting: float):
    """``(hidden, head, ids, teacher, chunk_size) -> loss_N``; ``teacher`` is what the objective
    reads."""
    from opd.objectives.jsd_head import chunked_jsd
    from opd.objectives.topk_head import chunked_topk_forward_kl
    from tests.reference import chunked_head_objective, generalized_jsd, topk_forward_kl

    def divergence(student_log, rows, teacher):
        if objective == "topk":
            top_ids, top_log = teacher
            return topk_forward_kl(student_log, top_ids[rows], top_log[rows])
        teacher_hidden, teacher_head = teacher
        with torch.no_grad():
            teacher_log = torch.log_softmax(teacher_head(teacher_hidden[rows]).float(), dim=-1)
        return generalized_jsd(student_log, teacher_log, setting)

    def naive(hidden, head, ids, teacher, chunk_size):
        return divergence(torch.log_softmax(head(hidden).float(), dim=-1), slice(None), teacher)

    def checkpointed(hidden, head, ids, teacher, chunk_size):
        row_loss = functools.partial(divergence, teacher=teacher)
        return chunked_head_objective(hidden, head, ids, row_loss, chunk_size=chunk_size)[0]

    def fused(hidden, head, ids, teacher, chunk_size):
        if objective == "topk":
            return chunked_topk_forward_kl(hidden, head, ids, *teacher, chunk_size=chunk_size)[0]
        return chunked_jsd(hidden, head, ids, *teacher, setting, chunk_size=chunk_size)[0]

    return {"naive": naive, "checkpointed": checkpointed, "fused": fused}[variant]


def run_one(args) -> dict:
    torch.manual_seed(0)
    head = torch.nn.Linear(args.dim, args.vocab, bias=False)
    teacher_head = torch.nn.Linear(args.dim, args.vocab, bias=False).requires_grad_(False)
    hidden = torch.randn(args.rows, args.dim, requires_grad=True)
    teacher_hidden = torch.randn(args.rows, args.dim)
    ids = torch.randint(0, args.vocab, (args.rows,))
    if args.objective == "topk":
        with torch.no_grad():
            top = torch.log_softmax(teacher_head(teacher_hidden), dim=-1).topk(
                int(args.setting), dim=-1
            )
        teacher = (top.indices, top.values)
    else:
        teacher = (teacher_hidden, teacher_head)
    loss_of = loss_function(args.child, args.objective, args.setting)
    baseline = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    seconds = []
    for call in range(args.calls + 1):
        hidden.grad, head.weight.grad = None, None
        started = time.perf_counter()
        loss = loss_of(hidden, head, ids, teacher, args.chunk_size)
        loss.sum().backward()
        if call:
            seconds.append(time.perf_counter() - started)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - baseline
    return {
        "seconds": statistics.median(seconds),
        "peak_mib": peak / 2**20,
        "loss": float(loss.detach().sum()),
        "grad_norm": float(head.weight.grad.norm()),
    }


def measure(variant: str, objective: str, setting: float, args) -> dict:
    flags = {flag: getattr(args, flag) for flag in ("rows", "dim", "vocab", "chunk_size", "calls")}
    return run_child(__file__, variant, {"objective": objective, "setting": setting, **flags})


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--objective", nargs="*", choices=OBJECTIVES, default=list(OBJECTIVES))
    parser.add_argument("--rows", type=int, default=256, help="scored positions (prompts x tokens)")
    parser.add_argument("--dim", type=int, default=576, help="hidden size (576 = SmolLM2-135M)")
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--chunk-size", type=int, default=1024)
    parser.add_argument(
        "--beta", type=float, nargs="*", default=[0.0, 1.0, 0.5], help="jsd's betas"
    )
    parser.add_argument(
        "--topk", type=int, nargs="*", default=[32], help="topk's teacher tokens per row"
    )
    parser.add_argument(
        "--calls", type=int, default=3, help="timed calls per process (after a warm-up)"
    )
    parser.add_argument("--repeats", type=int, default=2, help="processes per variant, alternating")
    parser.add_argument(
        "--out", type=Path, help="also write the results here as JSON, with their provenance"
    )
    parser.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("--setting", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        args.objective = args.objective[0]
        print(json.dumps(run_one(args)))
        return
    print(
        f"N={args.rows} D={args.dim} V={args.vocab} chunk={args.chunk_size} "
        f"threads={torch.get_num_threads()}; forward + backward of the head; medians; ratios to "
        "naive"
    )
    header = ("objective", "variant", "seconds", "time x", "peak MiB", "mem %", "loss")
    widths = (12, 13, 8, 7, 9, 6, 12)
    print(" ".join(f"{name:>{width}}" for name, width in zip(header, widths, strict=True)))
    rows = []
    for objective in args.objective:
        for setting in args.beta if objective == "jsd" else args.topk:
            runs, seconds, memory = alternating_medians(
                VARIANTS,
                args.repeats,
                functools.partial(measure, objective=objective, setting=setting, args=args),
            )
            label = f"jsd b={setting:g}" if objective == "jsd" else f"topk k={setting:g}"
            for variant in VARIANTS:
                print(
                    f"{label:>12} {variant:>13} {seconds[variant]:>8.3f} "
                    f"{seconds[variant] / seconds['naive']:>7.2f} {memory[variant]:>9.0f} "
                    f"{100 * memory[variant] / memory['naive']:>5.0f}% "
                    f"{runs[variant][0]['loss']:>12.4f}"
                )
                rows.append(
                    {
                        "objective": objective,
                        "setting": setting,
                        "variant": variant,
                        "seconds": seconds[variant],
                        "peak_mib": memory[variant],
                        "loss": runs[variant][0]["loss"],
                    }
                )
    settings = {k: v for k, v in vars(args).items() if k not in ("child", "setting", "out")}
    write_result(args.out, "bench/fused_heads.py", settings, rows)


if __name__ == "__main__":
    main()
