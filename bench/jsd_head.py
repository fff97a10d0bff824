"""Time and peak memory of the `jsd` head, forward + backward: fused vs autograd vs naive.

- ``naive``: the full (N, V) logits of student and teacher, ``generalized_jsd``, autograd.
- ``checkpointed``: ``chunked_head_objective`` with ``generalized_jsd`` per chunk (autograd
  inside activation checkpointing; what opd ran before ``chunked_jsd``).
- ``fused``: ``opd.objectives.jsd_head.chunked_jsd`` (in place, analytic gradient).

Each variant runs in its own process (peak = the rise of its high-water mark over the inputs
it holds); inside it, one warm-up call and then ``--calls`` timed ones (median). The student
head is trained (full fine-tuning), the teacher's is frozen. Ratios are against ``naive``.

    python bench/jsd_head.py                       # N=256 rows (8 x 32 tokens), D=576, V=49152
    python bench/jsd_head.py --rows 2048 --beta 0 1 0.5
"""

from __future__ import annotations

import argparse
import functools
import json
import resource
import statistics
import time

import torch
from isolated_runs import alternating_medians, run_child

VARIANTS = ("naive", "checkpointed", "fused")


def loss_function(variant: str, beta: float):
    from opd.logprobs import chunked_head_objective
    from opd.objectives.distribution import generalized_jsd
    from opd.objectives.jsd_head import chunked_jsd

    def naive(hidden, head, ids, teacher_hidden, teacher_head, chunk_size):
        student_log = torch.log_softmax(head(hidden).float(), dim=-1)
        with torch.no_grad():
            teacher_log = torch.log_softmax(teacher_head(teacher_hidden).float(), dim=-1)
        return generalized_jsd(student_log, teacher_log, beta)

    def checkpointed(hidden, head, ids, teacher_hidden, teacher_head, chunk_size):
        def row_loss(student_log, rows):
            with torch.no_grad():
                teacher_log = torch.log_softmax(teacher_head(teacher_hidden[rows]).float(), dim=-1)
            return generalized_jsd(student_log, teacher_log, beta)

        return chunked_head_objective(hidden, head, ids, row_loss, chunk_size=chunk_size)[0]

    def fused(hidden, head, ids, teacher_hidden, teacher_head, chunk_size):
        return chunked_jsd(hidden, head, ids, teacher_hidden, teacher_head, beta, chunk_size=chunk_size)[0]

    return {"naive": naive, "checkpointed": checkpointed, "fused": fused}[variant]


def run_one(args) -> dict:
    torch.manual_seed(0)
    head = torch.nn.Linear(args.dim, args.vocab, bias=False)
    teacher_head = torch.nn.Linear(args.dim, args.vocab, bias=False).requires_grad_(False)
    hidden = torch.randn(args.rows, args.dim, requires_grad=True)
    teacher_hidden = torch.randn(args.rows, args.dim)
    ids = torch.randint(0, args.vocab, (args.rows,))
    loss_of = loss_function(args.child, args.beta[0])
    baseline = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    seconds = []
    for call in range(args.calls + 1):
        hidden.grad, head.weight.grad = None, None
        started = time.perf_counter()
        loss = loss_of(hidden, head, ids, teacher_hidden, teacher_head, args.chunk_size)
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


def measure(variant: str, beta: float, args) -> dict:
    flags = {flag: getattr(args, flag) for flag in ("rows", "dim", "vocab", "chunk_size", "calls")}
    return run_child(__file__, variant, {"beta": beta, **flags})


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=256, help="scored positions (prompts x tokens)")
    parser.add_argument("--dim", type=int, default=576, help="hidden size (576 = SmolLM2-135M)")
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--chunk-size", type=int, default=1024)
    parser.add_argument("--beta", type=float, nargs="*", default=[0.0, 1.0, 0.5])
    parser.add_argument("--calls", type=int, default=3, help="timed calls per process (after a warm-up)")
    parser.add_argument("--repeats", type=int, default=2, help="processes per variant, alternating")
    parser.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(run_one(args)))
        return
    print(
        f"N={args.rows} D={args.dim} V={args.vocab} chunk={args.chunk_size} "
        f"threads={torch.get_num_threads()}; forward + backward of the jsd head; medians; ratios to naive"
    )
    header = ("beta", "variant", "seconds", "time x", "peak MiB", "mem %", "loss")
    print(" ".join(f"{name:>{width}}" for name, width in zip(header, (5, 13, 8, 7, 9, 6, 12), strict=True)))
    for beta in args.beta:
        runs, seconds, memory = alternating_medians(
            VARIANTS,
            args.repeats,
            functools.partial(measure, beta=beta, args=args),
        )
        for variant in VARIANTS:
            time_ratio = seconds[variant] / seconds["naive"]
            print(
                f"{beta:>5} {variant:>13} {seconds[variant]:>8.3f} {time_ratio:>7.2f} "
                f"{memory[variant]:>9.0f} {100 * memory[variant] / memory['naive']:>5.0f}% "
                f"{runs[variant][0]['loss']:>12.4f}"
            )


if __name__ == "__main__":
    main()
