"""``opd demo`` on a shared CPU: its wall time alone, beside a one-core pure-Python busy loop, and
beside another torch job with torch's default threads, with opd choosing its thread count (the
environment leaves OMP_NUM_THREADS unset) and with a thread per core (what the demo set before).
Prints each time and its ratio to the same setting alone, measured in one run; the demo's models
must be cached (run ``opd demo`` once).

    python bench/demo_contention.py --steps 150 --out docs/results/demo_contention.json
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from provenance import write_result

COMPETITORS = {
    "alone": None,
    "beside a busy loop": "while True: pass",
    "beside a torch job": "import torch\na = torch.randn(384, 384)\nwhile True: a @ a",
}
SETTINGS = {
    "opd's choice": {},
    "a thread per core": {"OMP_NUM_THREADS": str(os.cpu_count() or 1)},
}


def demo_seconds(steps: int, env: dict) -> float:
    with tempfile.TemporaryDirectory() as log_path:
        command = [
            sys.executable,
            "-m",
            "opd",
            "demo",
            "--steps",
            str(steps),
            "--log-path",
            log_path,
        ]
        started = time.perf_counter()
        subprocess.run(command, env=env, check=True, capture_output=True)
        return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument(
        "--out", type=Path, help="also write the results here as JSON, with their provenance"
    )
    args = parser.parse_args()
    base = {
        key: value
        for key, value in os.environ.items()
        if key not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
    }
    seconds: dict[str, dict[str, float]] = {}
    for setting, extra in SETTINGS.items():
        for condition, code in COMPETITORS.items():
            competitor = (
                None if code is None else subprocess.Popen([sys.executable, "-c", code], env=base)
            )
            try:
                time.sleep(
                    1.0
                )  # the competitor running before the demo starts, as a user's would be
                seconds.setdefault(setting, {})[condition] = demo_seconds(args.steps, base | extra)
            finally:
                if competitor is not None:
                    competitor.kill()
                    competitor.wait()
            print(f"{setting:18} {condition:20} {seconds[setting][condition]:7.1f} s", flush=True)
    ratios = {
        setting: {condition: times[condition] / times["alone"] for condition in times}
        for setting, times in seconds.items()
    }
    print()
    print(f"{'':18} " + " ".join(f"{condition:>20}" for condition in COMPETITORS))
    for setting, row in ratios.items():
        print(f"{setting:18} " + " ".join(f"{row[condition]:>19.2f}x" for condition in COMPETITORS))
    write_result(
        args.out,
        "bench/demo_contention.py",
        vars(args),
        {"seconds": seconds, "ratio_to_alone": ratios},
    )


if __name__ == "__main__":
    main()
