"""A long fuzz campaign: the property and fuzz tests with fresh random inputs, many per test.

Runs ``tests/test_properties.py``, ``tests/test_fuzz.py`` and the byte-level ``opd serve`` test
under the ``campaign`` hypothesis profile (random seed, ``--examples`` examples per test instead
of CI's fixed 40) and records, per test, the examples hypothesis tried and how many failed.
Any failure is printed with its minimal example by pytest and makes this script exit non-zero.

    python bench/fuzz_campaign.py --examples 2000 --out docs/results/fuzz_campaign.json
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

from provenance import write_result

ROOT = Path(__file__).resolve().parents[1]
TESTS = [
    "tests/test_properties.py",
    "tests/test_fuzz.py",
    "tests/test_serve_load.py::test_any_bytes_as_a_body_get_a_4xx_or_an_answer",
]
STATISTICS = re.compile(
    r"^(?P<test>\S+::\S+):\s*$"
    r"|^\s+- (?P<passing>\d+) passing, (?P<failing>\d+) failing, and (?P<invalid>\d+) invalid test "
    r"cases"
)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--examples", type=int, default=2000)
    parser.add_argument(
        "--out", type=Path, help="also write the results here as JSON, with their provenance"
    )
    args = parser.parse_args()
    environment = os.environ | {
        "HYPOTHESIS_PROFILE": "campaign",
        "OPD_FUZZ_EXAMPLES": str(args.examples),
    }
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "--hypothesis-show-statistics",
            *TESTS,
        ],
        cwd=ROOT,
        env=environment,
        capture_output=True,
        text=True,
    )
    per_test, current = {}, None
    for line in result.stdout.splitlines():
        match = STATISTICS.match(line)
        if not match:
            continue
        if match["test"]:
            current = match["test"]
        elif current:  # one line per phase (reuse, generate, shrink): summed
            counts = per_test.setdefault(current, {"passing": 0, "failing": 0, "invalid": 0})
            for key in counts:
                counts[key] += int(match[key])
    summary = (
        result.stdout.strip().splitlines()[-1] if result.stdout.strip() else result.stderr[-500:]
    )
    print("\n".join(f"{name}: {counts}" for name, counts in per_test.items()))
    print(summary)
    results = {
        "pytest_summary": summary,
        "exit_status": result.returncode,
        "examples_tried": sum(c["passing"] + c["failing"] for c in per_test.values()),
        "failing_examples": sum(c["failing"] for c in per_test.values()),
        "per_test": per_test,
    }
    write_result(args.out, "bench/fuzz_campaign.py", vars(args), results)
    if result.returncode:
        print(result.stdout[-5000:])
        raise SystemExit(result.returncode)


if __name__ == "__main__":
    main()
