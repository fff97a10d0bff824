"""Before / after: opd's training step and fused heads at a git revision and in this working tree.

Two long-lived workers, one importing opd from each tree, do the same work in turns: one step
(or one fused-head call) in the first, the same step in the second, then the other way round,
so that whatever this shared machine is doing at a moment falls on both sides of a pair. The
table gives each side's median and the median of the pairs' after / before ratios (1.00 = as
fast), with the range of the middle half of the pairs.

    python bench/before_after.py --base HEAD~3 --quick                  # the demo's tiny models
    python bench/before_after.py --base v0.1 --student DIR --teacher DIR --steps 10
    python bench/before_after.py --base v0.1 --heads-only --rows 256 1024

A step is ``bench/step_time.py``'s work (8 prompts, one completion each, at most 32 tokens,
full fine-tuning or LoRA rank 16); a head is ``bench/fused_heads.py``'s (forward + backward of
the fused ``jsd`` or ``topk_forward_kl`` head). On a shared machine one torch thread
(``--threads 1``) varies least. The base revision is checked out with ``git worktree`` into a
temporary directory and removed afterwards; ``--out`` writes the pairs with the commits, the
settings and the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from provenance import git_commit, write_result

ROOT = Path(__file__).resolve().parents[1]
OBJECTIVES = {"opd-sampled": "sampled_reverse_kl", "opd-jsd": "jsd", "opd-topk": "topk_forward_kl"}


def step_worker(args, tree: Path):
    """A trainer of ``tree``'s opd doing ``bench/step_time.py``'s work; returns ``step ->
    seconds``."""
    from opd.config import TrainingConfig, config_from_dict
    from opd.data.builtin_tasks import generate_task_prompts
    from opd.trainer.loop import Trainer

    name = OBJECTIVES[args.job]
    options = {"beta": 1.0} if name == "jsd" else {}
    flat = hasattr(TrainingConfig, "beta")  # before objectives took their options under their name
    objective = {"objective": name, **options} if flat else {"objective": {"name": name, **options}}
    directory = Path(tempfile.mkdtemp())
    prompts = generate_task_prompts("reverse", seed=123, count=args.prompts * (args.steps + 1))
    prompt_file = directory / "prompts.jsonl"
    prompt_file.write_text(
        "".join(json.dumps({"prompt": p.messages[0]["content"]}) + "\n" for p in prompts)
    )
    config = {
        "log_path": str(directory / "run"),
        "eval_every": 0,
        "save_every": 0,
        "student": {
            "model": args.student,
            "lora_rank": 16 if args.mode == "lora" else 0,
            "device": "cpu",
        },
        "teacher": {"model": args.teacher, "device": "cpu"},
        "datasets": [
            {
                "name": "bench",
                "source": str(prompt_file),
                "groups_per_batch": args.prompts,
                "group_size": 1,
            }
        ],
        "training": {
            "learning_rate": 1e-5,
            "max_tokens": args.max_tokens,
            "max_steps": args.steps + 1,
        }
        | objective,
    }
    trainer = Trainer(config_from_dict(config), progress=False)
    return lambda step: trainer.train_step(step)["time/total"]


def head_worker(args, tree: Path):
    """``tree``'s fused head on fixed inputs; returns ``call -> seconds`` of a forward +
    backward."""
    import torch

    from opd.objectives.jsd_head import chunked_jsd
    from opd.objectives.topk_head import chunked_topk_forward_kl

    objective, _, setting = args.job.partition("=")
    torch.manual_seed(0)
    head = torch.nn.Linear(args.dim, args.vocab, bias=False)
    teacher_head = torch.nn.Linear(args.dim, args.vocab, bias=False).requires_grad_(False)
    hidden = torch.randn(int(args.mode), args.dim, requires_grad=True)
    teacher_hidden = torch.randn(int(args.mode), args.dim)
    ids = torch.randint(0, args.vocab, (int(args.mode),))
    with torch.no_grad():
        top = torch.log_softmax(teacher_head(teacher_hidden), dim=-1).topk(
            int(float(setting)), dim=-1
        )

    def call(_: int) -> float:
        hidden.grad, head.weight.grad = None, None
        started = time.perf_counter()
        if objective == "topk":
            loss = chunked_topk_forward_kl(
                hidden, head, ids, top.indices, top.values, chunk_size=args.chunk_size
            )
        else:
            loss = chunked_jsd(
                hidden,
                head,
                ids,
                teacher_hidden,
                teacher_head,
                float(setting),
                chunk_size=args.chunk_size,
            )
        loss[0].sum().backward()
        return time.perf_counter() - started

    return call


def serve(args) -> None:
    """The worker: build once, then answer each line ``N`` on stdin with the seconds of unit N."""
    tree = Path(args.worker_tree)
    sys.path.insert(0, str(tree / "src"))
    os.environ["TQDM_DISABLE"] = "1"
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    work = step_worker(args, tree) if args.kind == "step" else head_worker(args, tree)
    import opd

    print(json.dumps({"ready": str(Path(opd.__file__).parent)}), flush=True)
    for line in sys.stdin:
        print(json.dumps({"seconds": work(int(line))}), flush=True)


class Worker:
    """One side's worker process."""

    def __init__(self, args, tree: Path, kind: str, job: str, mode: str):
        command = [
            sys.executable,
            __file__,
            "--worker-tree",
            str(tree),
            "--kind",
            kind,
            "--job",
            job,
            "--mode",
            mode,
        ]
        for flag in (
            "student",
            "teacher",
            "prompts",
            "max_tokens",
            "steps",
            "dim",
            "vocab",
            "chunk_size",
            "threads",
        ):
            if getattr(args, flag) is not None:
                command += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
        self.process = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        self.opd_path = self._read()["ready"]

    def _read(self) -> dict:
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"a worker exited with {self.process.wait()} (its error is above)")
        return json.loads(line)

    def run(self, unit: int) -> float:
        self.process.stdin.write(f"{unit}\n")
        self.process.stdin.flush()
        return self._read()["seconds"]

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait()


def paired(args, trees: dict[str, Path], kind: str, job: str, mode: str) -> dict:
    """Both sides' seconds for the same units, taken in turns (unit 0 is a warm-up, not kept)."""
    workers = {side: Worker(args, tree, kind, job, mode) for side, tree in trees.items()}
    units = args.steps if kind == "step" else args.calls
    seconds: dict[str, list[float]] = {side: [] for side in workers}
    try:
        for side in workers:
            workers[side].run(0)
        for unit in range(1, units + 1):
            order = list(workers) if unit % 2 else list(workers)[::-1]
            for side in order:
                seconds[side].append(workers[side].run(unit))
    finally:
        for worker in workers.values():
            worker.close()
    ratios = sorted(a / b for a, b in zip(seconds["after"], seconds["before"], strict=True))
    quartiles = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
    return {
        "kind": kind,
        "job": job,
        "mode": mode,
        "before_seconds": statistics.median(seconds["before"]),
        "after_seconds": statistics.median(seconds["after"]),
        "ratio": statistics.median(ratios),
        "ratio_quartiles": [quartiles[0], quartiles[2]],
        "seconds": seconds,
        "opd_paths": {side: worker.opd_path for side, worker in workers.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--base", help="the git revision to compare this working tree with")
    parser.add_argument(
        "--quick", action="store_true", help="the demo's tiny models (run `opd demo` once first)"
    )
    parser.add_argument("--student")
    parser.add_argument("--teacher")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument(
        "--steps", type=int, default=10, help="timed steps per (tool, mode) and side"
    )
    parser.add_argument("--tools", nargs="*", default=list(OBJECTIVES), choices=list(OBJECTIVES))
    parser.add_argument("--modes", nargs="*", default=["full", "lora"], choices=["full", "lora"])
    parser.add_argument("--heads", nargs="*", default=["jsd=0", "jsd=1", "jsd=0.5", "topk=32"])
    parser.add_argument(
        "--rows", nargs="*", type=int, default=[256, 1024], help="fused heads: rows"
    )
    parser.add_argument("--dim", type=int, default=576)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--chunk-size", type=int, default=1024)
    parser.add_argument(
        "--calls", type=int, default=10, help="fused heads: timed calls per head and side"
    )
    parser.add_argument("--threads", type=int, help="torch threads per worker (default: torch's)")
    parser.add_argument("--heads-only", action="store_true")
    parser.add_argument("--steps-only", action="store_true")
    parser.add_argument(
        "--out", type=Path, help="write the pairs here as JSON, with their provenance"
    )
    for hidden in ("worker-tree", "kind", "job", "mode"):
        parser.add_argument(f"--{hidden}", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker_tree:
        serve(args)
        return
    if not args.base:
        parser.error("give --base REVISION")
    if args.quick:
        cache = Path(os.environ.get("OPD_CACHE", Path.home() / ".cache" / "opd")) / "demo-v2"
        args.student, args.teacher = str(cache / "student"), str(cache / "teacher")
        args.max_tokens = min(args.max_tokens, 10)
    if not args.heads_only and not (args.student and args.teacher):
        parser.error("give --student and --teacher, or --quick (or --heads-only)")
    jobs = [] if args.heads_only else [("step", t, m) for m in args.modes for t in args.tools]
    jobs += [] if args.steps_only else [("head", h, str(r)) for r in args.rows for h in args.heads]
    base_commit = subprocess.run(
        ["git", "rev-parse", args.base], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.strip()
    print(f"before: {base_commit[:12]}   after: this tree ({git_commit(ROOT)[:12]}...)")
    print(
        f"{'what':>16} {'mode':>6} {'before s':>9} {'after s':>9} {'after/before':>12} "
        f"{'middle half':>13}"
    )
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        base_tree = Path(scratch) / "base"
        add = ["git", "worktree", "add", "-q", "--detach", str(base_tree), base_commit]
        subprocess.run(add, cwd=ROOT, check=True)
        try:
            for kind, job, mode in jobs:
                row = paired(args, {"before": base_tree, "after": ROOT}, kind, job, mode)
                low, high = row["ratio_quartiles"]
                label = job if kind == "step" else f"head {job}"
                print(
                    f"{label:>16} {mode if kind == 'step' else mode + 'r':>6} "
                    f"{row['before_seconds']:9.3f} {row['after_seconds']:9.3f} "
                    f"{row['ratio']:12.3f} {low:6.3f}-{high:.3f}",
                    flush=True,
                )
                rows.append(row)
        finally:
            subprocess.run(
                ["git", "worktree", "remove", "--force", str(base_tree)], cwd=ROOT, check=True
            )
    settings = {
        k: v
        for k, v in vars(args).items()
        if k not in ("worker_tree", "kind", "job", "mode", "out")
    }
    write_result(args.out, "bench/before_after.py", settings, rows, base_commit=base_commit)


if __name__ == "__main__":
    main()
