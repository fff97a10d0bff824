"""Bench variants each in a fresh process, alternated, summarised by medians.

A fresh process per measurement gives each variant its own peak-memory high-water mark;
alternating the variants spreads this shared machine's drift over all of them alike.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from collections.abc import Callable


def run_child(script: str, variant: str, flags: dict[str, object]) -> dict:
    """``script --child VARIANT --flag value ...`` in a new interpreter; its last stdout line is
    JSON."""
    command = [sys.executable, script, "--child", variant]
    for flag, value in flags.items():
        command += [f"--{flag.replace('_', '-')}", str(value)]
    output = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    return json.loads(output.strip().splitlines()[-1])


def alternating_medians(
    variants: tuple[str, ...], repeats: int, measure: Callable[[str], dict]
) -> tuple[dict[str, list[dict]], dict[str, float], dict[str, float]]:
    """Every run per variant, and the median ``seconds`` and ``peak_mib`` of each variant's runs."""
    runs: dict[str, list[dict]] = {variant: [] for variant in variants}
    for _ in range(repeats):
        for variant in variants:
            runs[variant].append(measure(variant))
    seconds = {
        variant: statistics.median(r["seconds"] for r in runs[variant]) for variant in variants
    }
    memory = {
        variant: statistics.median(r["peak_mib"] for r in runs[variant]) for variant in variants
    }
    return runs, seconds, memory
