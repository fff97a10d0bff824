"""The report's diagnosis: what the figures that say why a run stalls mean, read from its metrics,
and what to try where a measured rule exists (the watchdog's checks replayed over the run)."""

from __future__ import annotations

import html
import math

from opd.runs.watchdog import Watchdog

MEANINGS: dict[str, str] = {
    "group/distinct": (
        "share of distinct completions in a group (1: all different; 1/group_size: one answer "
        "drawn every time). Near its floor, the samples of a prompt no longer differ, so neither "
        "the reward nor a comparison within the group can tell a right answer from a wrong one"
    ),
    "reward/constant_groups": (
        "share of groups whose rewards are all equal: those carry no reward signal (centred within "
        "the group, their reward term is 0). At 1 the reward teaches nothing"
    ),
    "reward/mean": "the task's mean reward on the student's own samples (graded, or the episode's "
    "sum)",
    "reward_share": (
        "the reward's share of the advantage: mean |reward term| / (mean |reward term| + mean "
        "|teacher term|) per completion token"
    ),
    "entropy": (
        "the student's entropy on its own samples, nats per token. Very low while held-out "
        "accuracy is still far from the teacher's: the student is confident in its mistakes"
    ),
    "teacher_kl/answer": (
        "teacher KL per token on the answer the grader reads, beside the rest of the completion "
        "(teacher_kl/reasoning): where the student and teacher still disagree"
    ),
    "diag/first_wrong_teacher_prob": (
        "the teacher's probability of the student's token where a wrong answer first parts from "
        "the right one: near 0, the teacher's signal points at the mistake; near 1, the teacher "
        "agreed with it (the error came earlier, or the teacher makes it too)"
    ),
    "teacher/topk_mass": (
        "the probability the teacher's top-k tokens hold at the student's positions: well below 1, "
        "the top-k objectives see only part of the teacher's distribution (raise topk)"
    ),
}


def reward_share(row: dict) -> float | None:
    """The reward's share of a step's advantage (None without both terms)."""
    reward, kl = row.get("advantage/reward_abs_mean"), row.get("advantage/kl_abs_mean")
    if reward is None or kl is None or reward + kl <= 0:
        return None
    return reward / (reward + kl)


def _first_last(rows: list[dict], key: str) -> tuple[float, float] | None:
    values = [row[key] for row in rows if isinstance(row.get(key), int | float)]
    values = [v for v in values if math.isfinite(v)]
    return (values[0], values[-1]) if values else None


def diagnosis_lines(rows: list[dict]) -> list[tuple[str, str]]:
    """(figure, what it means with the run's first and last value) for each figure the run
    logged."""
    train_rows = [row | {"reward_share": reward_share(row)} for row in rows if "loss" in row]
    lines = []
    for key, meaning in MEANINGS.items():
        span = _first_last(train_rows, key)
        if span is not None:
            lines.append((key, f"{span[0]:.3g} &rarr; {span[1]:.3g}: {meaning}"))
    return lines


def batch_shape_advice(config: dict) -> list[str]:
    """A dataset sampling several completions a prompt while no reward is centred in the groups:
    on the lab one sample of each of 32 prompts learned far more than four of each of 8."""
    training = config.get("training") or {}
    if training.get("reward_coef") or training.get("data_source") == "dataset":
        return []
    advice = []
    for index, dataset in enumerate(config.get("datasets") or []):
        size, prompts = dataset.get("group_size"), dataset.get("groups_per_batch")
        if isinstance(size, int) and isinstance(prompts, int) and size > 1:
            advice.append(
                f"datasets[{index}] samples {size} completions of each of {prompts} prompts a "
                "step, and no reward compares them: the same samples on more prompts "
                f"(groups_per_batch: {prompts * size}, group_size: 1) learned far more per step "
                "and per FLOP on the lab's tasks (docs/quality.md)"
            )
    return advice


def what_to_try(rows: list[dict], config: dict | None = None) -> list[str]:
    """Each symptom the watchdog finds over the run's metrics, with its advice, first seen first;
    then the measured rules about the run's settings (``config``: its recorded ``config.yaml``)."""
    watchdog = Watchdog()
    found = []
    for row in rows:
        for symptom in watchdog.check(row):
            found.append(f"step {row.get('step', '?')}: {symptom.message}")
    return found + batch_shape_advice(config or {})


def diagnosis_html(rows: list[dict], config: dict) -> str:
    """The report's section: the diagnostic figures' meaning with the run's values, then what to
    try (the watchdog's rules replayed, the measured rules about the run's settings)."""
    lines = "".join(
        f"<tr><td>{html.escape(key)}</td><td>{text}</td></tr>"
        for key, text in diagnosis_lines(rows)
    )
    advice = what_to_try(rows, config)
    tried = (
        "<p><b>What to try</b> (rules measured on this project's runs):</p><ul>"
        + "".join(f"<li>{html.escape(line)}</li>" for line in advice)
        + "</ul>"
        if advice
        else "<p>No rule of the watchdog fired: no collapse, divergence or stall it knows of.</p>"
    )
    table = f'<table class="summary">{lines}</table>' if lines else ""
    return table + tried
