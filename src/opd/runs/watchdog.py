"""A watch on each step's metrics for the signs that a run is going wrong.

Each symptom is named once, when first seen, with its likely cause and the setting to change:
the entropy collapsing, the teacher KL rising step after step, the sampler's log-probs parting
from the trainer's (``kl_sample_train``), the gradient norm exploding (twice in a row, or once with
the teacher KL following it up), held-out accuracy falling, a reward that no group tells apart.
With ``training.stop_on_divergence`` the run stops at the first one instead of going on.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import pairwise

from opd.config import Config

WINDOW = 5
"""Steps a trend must last (or a baseline must hold) before it counts."""
ENTROPY_FLOOR = 0.1
"""Entropy collapse: below this fraction of the first step's entropy."""
KL_SAMPLE_TRAIN_LIMIT = 0.1
"""Sampler and trainer disagree: more than this many nats per token between their log-probs."""
GRAD_NORM_FACTOR = 10.0
"""Exploding gradients: a norm this many times the median of the steps before."""
ACCURACY_DROP = 0.1
"""Falling accuracy: this far (absolute) below the first held-out evaluation..."""
ACCURACY_NOISE_Z = 3.0
"""... and this many standard errors of the difference of the two accuracies, each a share of the
held-out prompts (binomial), so that a dip a small held-out set makes by chance is not reported."""


@dataclass
class Symptom:
    """A sign the run is going wrong, found in the metrics of one step."""

    name: str
    message: str


def _values(history: list[dict], key: str) -> list[float]:
    """The finite values ``key`` took, in step order (rows without it skipped)."""
    return [
        row[key]
        for row in history
        if isinstance(row.get(key), int | float) and math.isfinite(row[key])
    ]


def entropy_collapse(history: list[dict], config: Config | None = None) -> Symptom | None:
    """The entropy below a tenth of the first step's, after at least WINDOW steps."""
    entropies = _values(history, "entropy")
    if (
        len(entropies) > WINDOW
        and entropies[0] > 0
        and entropies[-1] < ENTROPY_FLOOR * entropies[0]
    ):
        return Symptom(
            "entropy_collapse",
            f"entropy fell from {entropies[0]:.3g} to {entropies[-1]:.3g} nats/token: the student "
            "is settling on a few tokens. Fine if its teacher is as sure (short exact answers) "
            "and held-out accuracy rises; if not, the updates are too large (lower "
            "training.learning_rate) or the sampled reverse KL is pulling a far-off student onto "
            "answers of its own (training.objective: topk_forward_kl; docs/defaults.md)",
        )
    return None


def teacher_kl_rising(history: list[dict], config: Config | None = None) -> Symptom | None:
    """The teacher KL higher at each of the last WINDOW steps than at the step before."""
    kls = _values(history, "teacher_kl")[-(WINDOW + 1) :]
    if len(kls) == WINDOW + 1 and all(a < b for a, b in pairwise(kls)):
        return Symptom(
            "teacher_kl_rising",
            f"teacher_kl rose for {WINDOW} steps in a row ({kls[0]:.3g} -> {kls[-1]:.3g}): the "
            "student is moving away from the teacher. Lower training.learning_rate, or try "
            "training.objective: jsd",
        )
    return None


def sampler_apart(history: list[dict], config: Config | None = None) -> Symptom | None:
    """This step's ``kl_sample_train`` beyond KL_SAMPLE_TRAIN_LIMIT."""
    values = _values(history[-1:], "kl_sample_train")
    if values and abs(values[0]) > KL_SAMPLE_TRAIN_LIMIT:
        causes = []
        if config is None or config.student.sampling_dtype is not None:
            causes.append("student.sampling_dtype (a low-precision copy samples)")
        if config is None or config.training.max_staleness > 0:
            causes.append("training.max_staleness (samples from older weights; lower it)")
        if config is None or config.student.sampler != "hf":
            causes.append("the rollout engine's weight sync (student.sampler)")
        check = (
            f"Check {', or '.join(causes)}"
            if causes
            else "Check the student's weights reach the sampler"
        )
        return Symptom(
            "kl_sample_train",
            f"kl_sample_train is {values[0]:.3g} nats/token: the sampler's log-probs are far from "
            f"the trainer's on the same tokens, so the importance ratios are off. {check}",
        )
    return None


def _spike(norms: list[float], at: int) -> float | None:
    """How many times the median of the norms before it step ``at``'s norm is, where that is over
    GRAD_NORM_FACTOR (None: no spike, or too few steps before it for a baseline)."""
    if at < WINDOW:
        return None
    usual = statistics.median(norms[:at])
    if usual > 0 and norms[at] > GRAD_NORM_FACTOR * usual:
        return norms[at] / usual
    return None


def grad_norm_exploding(history: list[dict], config: Config | None = None) -> Symptom | None:
    """The gradient norm GRAD_NORM_FACTOR times its median so far on two steps in a row, or once
    with the teacher KL (the loss without a teacher) more than doubled on the step after it. One
    spike that the next step forgets is no divergence, the more so when every step is clipped."""
    norms = _values(history, "grad_norm")
    if len(norms) < 2:
        return None
    last, before = _spike(norms, len(norms) - 1), _spike(norms, len(norms) - 2)
    if before is None:
        return None
    if last is None:
        followed = _values(history, "teacher_kl") or _values(history, "loss")
        baseline = statistics.median(followed[:-2]) if len(followed) > 2 else 0.0
        if not (baseline > 0 and followed[-1] > 2 * baseline):
            return None
    clip = config.training.max_grad_norm if config is not None else None
    advice = (
        f"every step is already clipped to training.max_grad_norm {clip:g}: lower "
        "training.learning_rate"
        if clip is not None
        else "Lower training.learning_rate, or set training.max_grad_norm (1.0 clips most runs' "
        "spikes)"
    )
    return Symptom(
        "grad_norm_exploding",
        f"grad_norm {norms[-1]:.3g} is {norms[-1] / statistics.median(norms[:-1]):.0f}x its median "
        f"so far ({statistics.median(norms[:-1]):.3g}), after {norms[-2]:.3g} the step before: the "
        f"update is blowing up. {advice[0].upper()}{advice[1:]}",
    )


def accuracy_falling(history: list[dict], config: Config | None = None) -> Symptom | None:
    """A held-out accuracy below its first evaluation by ACCURACY_DROP and by more than the noise of
    two evaluations on ``test/<name>/num_prompts`` prompts (runs that did not log it: the drop
    alone)."""
    keys = sorted(
        {
            key
            for row in history
            for key in row
            if key.startswith("test/") and key.endswith("/accuracy")
        }
    )
    for key in keys:
        accuracies = _values(history, key)
        if len(accuracies) < 2:
            continue
        first, last = accuracies[0], accuracies[-1]
        sizes = _values(history, key.removesuffix("accuracy") + "num_prompts")
        noise = (
            ACCURACY_NOISE_Z * math.sqrt((first * (1 - first) + last * (1 - last)) / sizes[-1])
            if sizes and sizes[-1] > 0
            else 0.0
        )
        if first - last > max(ACCURACY_DROP, noise):
            beyond = (
                f", beyond the noise of {sizes[-1]:.0f} held-out prompts (±{noise:.1%})"
                if noise
                else ""
            )
            return Symptom(
                "accuracy_falling",
                f"{key} fell from {first:.1%} to {last:.1%}{beyond}: training is making the "
                "student worse on held-out prompts. Lower training.learning_rate, or check the "
                "teacher",
            )
    return None


def reward_signal_gone(history: list[dict], config: Config | None = None) -> Symptom | None:
    """Every group's rewards equal for WINDOW steps in a row while the reward is in the advantage
    (``advantage/reward_abs_mean`` logged): the reward term is 0 on every token."""
    rows = [row for row in history if "reward/constant_groups" in row][-WINDOW:]
    if (
        len(rows) == WINDOW
        and all(row["reward/constant_groups"] >= 1.0 for row in rows)
        and any("advantage/reward_abs_mean" in row for row in rows)
    ):
        return Symptom(
            "reward_signal_gone",
            f"every group's samples got the same reward for {WINDOW} steps (reward/constant_groups "
            "1): "
            "the reward term is 0 and teaches nothing. A student that never gets it right learns "
            "the task from the teacher's samples first (training.data_source: mixed with "
            "training.lmbda: {start: 0, end: 1, steps: N}: 0% -> 31% on the calculator task, "
            "docs/environments.md)",
        )
    return None


CHECKS: list[Callable[[list[dict], Config | None], Symptom | None]] = [
    entropy_collapse,
    teacher_kl_rising,
    sampler_apart,
    grad_norm_exploding,
    accuracy_falling,
    reward_signal_gone,
]


@dataclass
class Watchdog:
    """Reads every step's metrics; reports each symptom the first time it shows, its advice fitted
    to the run's ``config`` (never a setting to set that is set already)."""

    config: Config | None = None
    history: list[dict] = field(default_factory=list)
    seen: set[str] = field(default_factory=set)

    def check(self, metrics: dict) -> list[Symptom]:
        """The symptoms that show for the first time with this step's ``metrics``."""
        self.history.append(metrics)
        found = []
        for check in CHECKS:
            symptom = check(self.history, self.config)
            if symptom is not None and symptom.name not in self.seen:
                self.seen.add(symptom.name)
                found.append(symptom)
        return found
