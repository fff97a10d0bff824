"""Peak memory and time of chunked vs naive selected-token log-probs (forward + backward).

Each variant runs in its own process; peak memory is the rise of the process's high-water
mark (CPU) or of ``torch.cuda.max_memory_allocated`` (GPU) over the inputs already held.
Ratios compare runs made in this invocation, on this machine.

    python bench/logprobs_memory.py                 # B=4, T=1024, D=576; V=49152 and 151936
    python bench/logprobs_memory.py --vocab 49152 --repeats 3
"""

from __future__ import annotations

import argparse
import functools
import json
import resource
import time
from pathlib import Path

import torch
from isolated_runs import alternating_medians, run_child
from provenance import write_result

from opd.logprobs import selected_token_logprobs  # imported here, not inside the timed call


def naive(hidden, weight, ids):
    logits = (hidden @ weight.T).float()
    return torch.log_softmax(logits, dim=-1).gather(-1, ids[:, None]).squeeze(-1)


def chunked(hidden, weight, ids, chunk_size, with_entropy):
    head = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    head.weight = weight
    return selected_token_logprobs(
        hidden, head, ids, chunk_size=chunk_size, with_entropy=with_entropy
    )[0]


VARIANTS = ("naive", "chunked", "chunked+entropy")


def peak_bytes(device: str) -> int:
    if device == "cuda":
        return torch.cuda.max_memory_allocated()
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def run_one(variant: str, rows: int, dim: int, vocab: int, chunk_size: int, device: str) -> dict:
    torch.manual_seed(0)
    hidden = torch.randn(rows, dim, device=device, requires_grad=True)
    weight = torch.nn.Parameter(torch.randn(vocab, dim, device=device) * 0.02)
    ids = torch.randint(0, vocab, (rows,), device=device)
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    baseline = peak_bytes(device)
    started = time.perf_counter()
    if variant == "naive":
        out = naive(hidden, weight, ids)
    else:
        out = chunked(hidden, weight, ids, chunk_size, with_entropy=variant == "chunked+entropy")
    out.sum().backward()
    if device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    return {
        "variant": variant,
        "seconds": seconds,
        "peak_mib": (peak_bytes(device) - baseline) / 2**20,
    }


def measure(variant: str, args, vocab: int) -> dict:
    flags = {flag: getattr(args, flag) for flag in ("batch", "seq", "dim", "chunk_size", "device")}
    return run_child(__file__, variant, {"vocab": vocab, **flags})


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--dim", type=int, default=576, help="hidden size (576 = SmolLM2-135M)")
    parser.add_argument("--vocab", type=int, nargs="*", default=[49152, 151936])
    parser.add_argument("--chunk-size", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--out", type=Path, help="also write the results here as JSON, with their provenance"
    )
    parser.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        result = run_one(
            args.child, args.batch * args.seq, args.dim, args.vocab[0], args.chunk_size, args.device
        )
        print(json.dumps(result))
        return
    print(
        f"B={args.batch} T={args.seq} D={args.dim} chunk={args.chunk_size} device={args.device} "
        f"threads={torch.get_num_threads()}"
    )
    print(
        "forward + backward of selected-token log-probs; medians; ratios against naive in this run"
    )
    print(f"{'vocab':>8} {'variant':>16} {'seconds':>8} {'time x':>7} {'peak MiB':>9} {'mem %':>6}")
    rows = []
    for vocab in args.vocab:
        _, seconds, memory = alternating_medians(
            VARIANTS,
            args.repeats,
            functools.partial(measure, args=args, vocab=vocab),
        )
        for variant in VARIANTS:
            time_ratio = seconds[variant] / seconds["naive"]
            memory_share = 100 * memory[variant] / memory["naive"]
            print(
                f"{vocab:>8} {variant:>16} {seconds[variant]:>8.3f} {time_ratio:>7.2f} "
                f"{memory[variant]:>9.0f} {memory_share:>5.0f}%"
            )
            rows.append(
                {
                    "vocab": vocab,
                    "variant": variant,
                    "seconds": seconds[variant],
                    "peak_mib": memory[variant],
                }
            )
    settings = {k: v for k, v in vars(args).items() if k not in ("child", "out")}
    write_result(args.out, "bench/logprobs_memory.py", settings, rows)


if __name__ == "__main__":
    main()
