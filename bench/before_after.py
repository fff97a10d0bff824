"""Before / after: opd's step time and fused heads at a git revision and in this working tree, in one run.

Each measurement runs in a fresh interpreter that imports opd from one of the two trees and
calls that tree's own bench code (``bench/step_time.py``'s ``run_opd`` for a training step,
``bench/fused_heads.py``'s ``run_one`` for a fused head), so each side runs the work its own
benches define. The two sides alternate, run after run, so this shared machine's drift falls
on both alike; the table gives medians and the after / before ratio (1.00 = as fast).

    python bench/before_after.py --base HEAD~3 --quick                  # the demo's tiny models
    python bench/before_after.py --base v0.1 --student DIR --teacher DIR --steps 3 --repeats 3
    python bench/before_after.py --base v0.1 --heads-only --rows 256 1024

On a shared machine one torch thread (``--threads 1``) varies least from run to run. The base
revision is checked out with ``git worktree`` into a temporary directory and removed
afterwards. Results go to ``--out`` as JSON with the commits, the settings and the machine.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from provenance import environment, git_commit

ROOT = Path(__file__).resolve().parents[1]
STEP_TOOLS = {"opd-sampled": "sampled_reverse_kl", "opd-jsd": "jsd", "opd-topk": "topk_forward_kl"}


def load_bench(tree: Path, name: str):
    """Import ``bench/<name>.py`` of ``tree`` with that tree's opd first on the path."""
    sys.path[:0] = [str(tree / "src"), str(tree / "bench"), str(tree)]
    spec = importlib.util.spec_from_file_location(f"bench_{name}", tree / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def child(args) -> None:
    """One measurement in this fresh interpreter; its result is the last line of stdout, as JSON."""
    tree = Path(args.child_tree)
    os.environ["TQDM_DISABLE"] = "1"
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    if args.child_kind == "step":
        step_time = load_bench(tree, "step_time")
        settings = argparse.Namespace(
            prompts=args.prompts,
            max_tokens=args.max_tokens,
            student=args.student,
            teacher=args.teacher,
            mode=args.child_mode,
            device="cpu",
        )
        result = step_time.run_opd(settings, args.steps + 1, STEP_TOOLS[args.child_tool], None, mixed=False)
        import opd

        result["opd_path"] = str(Path(opd.__file__).parent)
    else:
        fused_heads = load_bench(tree, "fused_heads")
        objective, _, setting = args.child_tool.partition("=")
        settings = argparse.Namespace(
            child="fused",
            objective=objective,
            setting=float(setting),
            rows=int(args.child_mode),
            dim=args.dim,
            vocab=args.vocab,
            chunk_size=args.chunk_size,
            calls=args.calls,
        )
        result = fused_heads.run_one(settings)
        result["step_seconds"] = [result["seconds"]]
    result["peak_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps(result))


def measure(args, tree: Path, kind: str, tool: str, mode: str) -> dict:
    command = [sys.executable, __file__, "--child-tree", str(tree), "--child-kind", kind]
    command += ["--child-tool", tool, "--child-mode", mode]
    for flag in (
        "student",
        "teacher",
        "prompts",
        "max_tokens",
        "steps",
        "dim",
        "vocab",
        "chunk_size",
        "calls",
        "threads",
    ):
        value = getattr(args, flag)
        if value is not None:
            command += [f"--{flag.replace('_', '-')}", str(value)]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{kind} {tool} {mode} at {tree} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


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
    parser.add_argument("--steps", type=int, default=3, help="timed steps per run, after one warm-up step")
    parser.add_argument("--repeats", type=int, default=3, help="runs per (side, tool, mode), alternating")
    parser.add_argument("--tools", nargs="*", default=list(STEP_TOOLS), choices=list(STEP_TOOLS))
    parser.add_argument("--modes", nargs="*", default=["full", "lora"], choices=["full", "lora"])
    parser.add_argument("--heads", nargs="*", default=["jsd=0", "jsd=1", "jsd=0.5", "topk=32"])
    parser.add_argument("--rows", nargs="*", type=int, default=[256, 1024], help="fused heads: rows")
    parser.add_argument("--dim", type=int, default=576)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--chunk-size", type=int, default=1024)
    parser.add_argument("--calls", type=int, default=3, help="fused heads: timed calls per run")
    parser.add_argument(
        "--threads", type=int, help="torch threads per run (default torch's: one per core); 1 is quieter"
    )
    parser.add_argument("--heads-only", action="store_true")
    parser.add_argument("--steps-only", action="store_true")
    parser.add_argument("--out", type=Path, help="write the results here as JSON")
    for hidden in ("child-tree", "child-kind", "child-tool", "child-mode"):
        parser.add_argument(f"--{hidden}", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child_tree:
        child(args)
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
    with tempfile.TemporaryDirectory() as scratch:
        base_tree = Path(scratch) / "base"
        subprocess.run(
            ["git", "worktree", "add", "-q", "--detach", str(base_tree), base_commit], cwd=ROOT, check=True
        )
        try:
            sides = {"before": base_tree, "after": ROOT}
            runs = {(side, *job): [] for side in sides for job in jobs}
            for repeat in range(args.repeats):
                for job in jobs:
                    order = list(sides.items())  # who goes first alternates: a warm cache favours neither
                    for side, tree in order if repeat % 2 == 0 else order[::-1]:
                        runs[(side, *job)].append(measure(args, tree, *job))
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(base_tree)], cwd=ROOT, check=True)
    print(f"before: {base_commit[:12]}   after: this tree ({git_commit(ROOT)})")
    print(f"{'what':>24} {'mode':>5} {'before s':>9} {'after s':>9} {'after/before':>12} {'peak ratio':>10}")
    rows = []
    for kind, tool, mode in jobs:
        before, after = (runs[(side, kind, tool, mode)] for side in ("before", "after"))
        seconds = [statistics.median(s for r in side for s in r["step_seconds"]) for side in (before, after)]
        peaks = [statistics.median(r["peak_mib"] for r in side) for side in (before, after)]
        label = tool if kind == "step" else f"head {tool}"
        mode_label = mode if kind == "step" else f"{mode}r"
        print(
            f"{label:>24} {mode_label:>5} {seconds[0]:9.3f} {seconds[1]:9.3f} "
            f"{seconds[1] / seconds[0]:12.3f} {peaks[1] / peaks[0]:10.3f}"
        )
        rows.append(
            {
                "kind": kind,
                "tool": tool,
                "mode": mode,
                "before_seconds": seconds[0],
                "after_seconds": seconds[1],
                "ratio": seconds[1] / seconds[0],
                "peak_ratio": peaks[1] / peaks[0],
                "runs": {"before": before, "after": after},
            }
        )
    if args.out:
        settings = {k: v for k, v in vars(args).items() if not k.startswith("child") and k != "out"}
        record = {
            "bench": "bench/before_after.py",
            "command": " ".join([Path(sys.executable).name, *sys.argv]),
            "commit": git_commit(ROOT),
            "base_commit": base_commit,
            "settings": settings,
            "environment": environment(),
            "results": rows,
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record, indent=1, default=str) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
