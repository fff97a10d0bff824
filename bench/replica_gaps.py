"""How far apart two answers to the remote teacher's replica probe are: the same weights in
another precision against other weights, on SmolLM2-135M-Instruct.

The probe (``opd.models.PROBE_TEXTS`` joined, as ``teacher.replica_probes`` sends it) is scored
by the float32 model, by the same weights in bfloat16 (what two replicas of one checkpoint on
different hardware differ by, at most) and by fine-tunes of it from the sample-efficiency bench
(cached teachers: a replica still serving another revision). Each line: the mean and largest
absolute gap per probe token to the float32 answer, against ``DISAGREEMENT_NATS``.

    python bench/replica_gaps.py --out docs/results/replica_gaps.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from provenance import environment, git_commit
from sample_efficiency import cache_root
from smollm2 import converted_dir
from transformers import AutoModelForCausalLM, AutoTokenizer

from opd.models import PROBE_TEXTS
from opd.teachers.replicas import DISAGREEMENT_NATS

ROOT = Path(__file__).resolve().parents[1]


@torch.no_grad()
def probe_logprobs(model_dir: Path, ids: list[int], dtype: torch.dtype) -> torch.Tensor:
    """Each probe token's log-prob after the ones before it (float32 out)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    logits = model(torch.tensor([ids])).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--out", type=Path, default=ROOT / "bench" / "results" / "replica_gaps.json"
    )
    args = parser.parse_args()
    base = converted_dir()
    ids = AutoTokenizer.from_pretrained(base).encode(
        " ".join(PROBE_TEXTS), add_special_tokens=False
    )
    reference = probe_logprobs(base, ids, torch.float32)
    answers = {
        "same weights, float32 again": (base, torch.float32),
        "same weights, bfloat16": (base, torch.bfloat16),
    }
    for teacher in sorted(cache_root().glob("teacher-*")):
        if (teacher / "config.json").exists():
            answers[f"fine-tuned: {teacher.name}"] = (teacher, torch.float32)
    rows = []
    for name, (model_dir, dtype) in answers.items():
        gap = (probe_logprobs(model_dir, ids, dtype) - reference).abs()
        rows.append({"answer": name, "mean_gap": gap.mean().item(), "max_gap": gap.max().item()})
        print(
            f"{name:45s} mean {rows[-1]['mean_gap']:.4f}  max {rows[-1]['max_gap']:.4f} nats",
            flush=True,
        )
    print(f"threshold (mean): {DISAGREEMENT_NATS} nats a token; probe: {len(ids)} tokens")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "bench": "bench/replica_gaps.py",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "commit": git_commit(ROOT),
        "environment": environment(),
        "probe_tokens": len(ids),
        "threshold_mean_nats": DISAGREEMENT_NATS,
        "rows": rows,
    }
    args.out.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
