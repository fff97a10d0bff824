"""Figures about a batch's multi-turn episodes, over every process's share: turns, length,
reward and success, the environment's own figures, and the teacher KL of each turn."""

from __future__ import annotations

from collections import defaultdict

import torch

from opd.data.sequences import RolloutBatch
from opd.distributed import all_gather_objects

SUCCESS = 1.0
"""The reward of a right answer (graded environments give 1.0); success rate counts these."""


def _sums(rollouts: RolloutBatch, reverse_kl_BT: torch.Tensor | None) -> dict[str, float]:
    sums: dict[str, float] = defaultdict(float)
    lengths = rollouts.attention_mask_BT.sum(-1).tolist()
    for row, trajectory in enumerate(rollouts.trajectories):
        if trajectory is None:
            continue
        sums["episodes"] += 1
        sums["turns"] += len(trajectory.turns)
        sums["len"] += lengths[row] - rollouts.prompt_lengths[row]
        sums["reward"] += trajectory.reward or 0.0
        sums["success"] += float((trajectory.reward or 0.0) >= SUCCESS)
        sums["cut"] += float(trajectory.ended != "done")
        for key, value in trajectory.metrics.items():
            sums[f"env/{key}"] += value
            sums[f"count/env/{key}"] += 1
        if reverse_kl_BT is None:
            continue
        offset = rollouts.prompt_lengths[row]
        for turn, (start, end) in enumerate(trajectory.turns, start=1):
            sums[f"teacher_kl/turn_{turn}"] += float(
                reverse_kl_BT[row, offset + start : offset + end].sum()
            )
            sums[f"count/teacher_kl/turn_{turn}"] += end - start
    return sums


def episode_metrics(
    rollouts: RolloutBatch, reverse_kl_BT: torch.Tensor | None = None
) -> dict[str, float]:
    """``episode/{turns,len,reward,success,cut}`` means per episode (``len``: tokens after the
    prompt, the environment's included; ``cut``: the share that ran out of turns or tokens),
    ``env/<key>`` means of the environment's figures, and ``teacher_kl/turn_<k>`` per token of
    turn k. Every process calls it (the sums are gathered); none when no row is an episode."""
    totals: dict[str, float] = defaultdict(float)
    for sums in all_gather_objects(dict(_sums(rollouts, reverse_kl_BT))):
        for key, value in sums.items():
            totals[key] += value
    episodes = totals.pop("episodes", 0.0)
    if not episodes:
        return {}
    metrics = {}
    for key, value in totals.items():
        if key.startswith("count/"):
            continue
        count = totals.get(f"count/{key}", episodes)
        name = key if "/" in key else f"episode/{key}"
        metrics[name] = value / max(count, 1.0)
    return metrics
