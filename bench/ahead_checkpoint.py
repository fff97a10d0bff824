"""What exact resume with collection ahead costs a checkpoint: its size and the seconds to save it,
``training.max_staleness`` 0 (nothing in flight), 1 and 2, on SmolLM2-135M-Instruct.

Each run: the student and the teacher are SmolLM2-135M-Instruct (bench/smollm2.py; the numbers
here are about checkpoints, not learning), full fine-tune in float32, 4 prompts x 2 samples of up
to 16 tokens a step, a checkpoint after every step, 6 steps. A checkpoint of a run collecting
ahead also holds the weights its batches in collection were handed (``in_flight/``: one copy of
the sampler weights per version, at most k). Size: the bytes of the checkpoint after step 3
(the last ones hold fewer steps in flight: the run ends); seconds: the median of
``time/checkpoint``.

    python bench/ahead_checkpoint.py --out docs/results/ahead_checkpoint.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from provenance import write_result
from smollm2 import converted_dir


def size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def one_run(model: Path, staleness: int, steps: int, root: Path) -> dict:
    from opd.config import config_from_dict, config_to_dict
    from opd.runs.checkpoints import list_checkpoints
    from opd.trainer.loop import train

    prompts = root / "prompts.jsonl"
    words = ("apple", "river", "stone", "cloud", "ember", "frost", "grain", "honey")
    prompts.write_text(
        "".join(json.dumps({"prompt": f"Spell {w} backwards."}) + "\n" for w in words)
    )
    log_path = root / f"run-k{staleness}"
    config = config_from_dict(
        {
            "log_path": str(log_path),
            "seed": 0,
            "save_every": 1,
            "eval_every": 0,
            "student": {"model": str(model), "lora_rank": 0},
            "teacher": {"model": str(model)},
            "datasets": [
                {"name": "spell", "source": str(prompts), "groups_per_batch": 4, "group_size": 2}
            ],
            "training": {"max_steps": steps, "max_tokens": 16, "max_staleness": staleness},
        }
    )
    rows = train(config, progress=False).metrics
    checkpoints = list_checkpoints(log_path)
    inner = next(c.path for c in checkpoints if c.step == 3)
    in_flight = inner / "in_flight"
    return {
        "max_staleness": staleness,
        "checkpoint_bytes": size(inner),
        "in_flight_bytes": size(in_flight) if in_flight.exists() else 0,
        "in_flight_versions": len(list(in_flight.glob("*.safetensors")))
        if in_flight.exists()
        else 0,
        "model_bytes": size(inner / "model"),
        "checkpoint_seconds": [
            round(r["time/checkpoint"], 3) for r in rows if "time/checkpoint" in r
        ],
        "checkpoint_seconds_median": statistics.median(
            r["time/checkpoint"] for r in rows if "time/checkpoint" in r
        ),
        "config": config_to_dict(config),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--staleness", type=int, nargs="*", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument(
        "--out", type=Path, help="also write the results here as JSON, with their provenance"
    )
    args = parser.parse_args()
    model = converted_dir()
    runs = []
    with tempfile.TemporaryDirectory() as directory:
        for staleness in args.staleness:
            run = one_run(model, staleness, args.steps, Path(directory))
            runs.append(run)
            print(
                f"max_staleness {staleness}: checkpoint {run['checkpoint_bytes'] / 2**20:.0f} MiB "
                f"(in flight {run['in_flight_bytes'] / 2**20:.0f} MiB, {run['in_flight_versions']} "
                f"versions), saved in {run['checkpoint_seconds_median']:.2f} s (median)"
            )
    write_result(
        args.out, "bench/ahead_checkpoint.py", vars(args) | {"model": str(model)}, {"runs": runs}
    )


if __name__ == "__main__":
    main()
