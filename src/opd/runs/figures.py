"""The PNG figures of ``opd report``: curves against steps, the time split per phase and one
step's timeline, drawn with matplotlib (imported only when a report is built)."""

from __future__ import annotations

from pathlib import Path

PHASES = ("sample", "teacher", "train", "eval", "checkpoint")
PHASE_COLOURS = {
    "sample": "#4c72b0",
    "teacher": "#dd8452",
    "train": "#55a868",
    "eval": "#8172b3",
    "checkpoint": "#937860",
}


def series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    points = [(row["step"], row[key]) for row in rows if row.get(key) is not None]
    return [p[0] for p in points], [p[1] for p in points]


def line_figure(
    title: str, curves: dict[str, tuple[list, list]], ylabel: str, path: Path
) -> Path | None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves = {name: xy for name, xy in curves.items() if xy[0]}
    if not curves:
        return None
    fig, ax = plt.subplots(figsize=(6, 3.4), dpi=110)
    for name, (steps, values) in curves.items():
        ax.plot(steps, values, marker="o" if len(steps) < 30 else None, markersize=3, label=name)
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


STEP_PHASES = ("sample", "teacher", "train")
"""Phases every step has, drawn as smoothed stacked areas; the occasional ones (evaluation,
checkpoint) are drawn as points at the steps they ran, where an average would hide them."""


def smoothed(values: list[float], window: int) -> list[float]:
    """Trailing mean over ``window`` values (fewer at the start)."""
    out, total = [], 0.0
    for index, value in enumerate(values):
        total += value - (values[index - window] if index >= window else 0.0)
        out.append(total / min(index + 1, window))
    return out


def time_split(rows: list[dict], path: Path) -> Path | None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [row for row in rows if "time/total" in row]
    if not rows:
        return None
    window = max(1, len(rows) // 40)
    fig, ax = plt.subplots(figsize=(6, 3.4), dpi=110)
    steps = [row["step"] for row in rows]
    stacked = {
        phase: smoothed([row.get(f"time/{phase}") or 0.0 for row in rows], window)
        for phase in STEP_PHASES
    }
    stacked = {phase: values for phase, values in stacked.items() if any(values)}
    ax.stackplot(
        steps,
        *stacked.values(),
        labels=list(stacked),
        colors=[PHASE_COLOURS[phase] for phase in stacked],
        alpha=0.85,
    )
    for phase in PHASES:
        if phase in STEP_PHASES:
            continue
        marked = [(row["step"], row[f"time/{phase}"]) for row in rows if row.get(f"time/{phase}")]
        if marked:
            ax.scatter(
                *zip(*marked, strict=True),
                s=14,
                color=PHASE_COLOURS[phase],
                label=f"{phase} (when run)",
            )
    smoothing = f", mean of {window} steps" if window > 1 else ""
    ax.set_title(f"seconds per step, by phase{smoothing}")
    ax.set_xlabel("step")
    ax.set_ylabel("seconds")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def gantt(spans: list[dict], step: int, path: Path) -> Path | None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    chosen = [span for span in spans if span["step"] == step]
    if not chosen:
        return None
    origin = min(span["start"] for span in chosen)
    fig, ax = plt.subplots(figsize=(6, 2.2), dpi=110)
    names = [name for name in PHASES if any(span["name"] == name for span in chosen)]
    for span in chosen:
        ax.barh(
            names.index(span["name"]),
            span["end"] - span["start"],
            left=span["start"] - origin,
            color=PHASE_COLOURS.get(span["name"], "#999"),
        )
    ax.set_yticks(range(len(names)), names)
    ax.set_xlabel("seconds from the start of the step")
    ax.set_title(f"timeline of step {step}")
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def distinct(curves: dict[str, tuple[list, list]]) -> dict[str, tuple[list, list]]:
    """The curves less any that repeats one before it (one dataset's ``teacher_kl/<name>`` is
    ``teacher_kl``: drawn twice, one hides the other)."""
    kept: dict[str, tuple[list, list]] = {}
    for key, curve in curves.items():
        if curve not in kept.values():
            kept[key] = curve
    return kept
