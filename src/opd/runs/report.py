"""``opd report``: one self-contained HTML page (plus PNGs) that shows how a run went.

Curves of teacher KL, held-out accuracy, entropy and the per-phase time split, a timeline
of one step, and sample completions at chosen steps with each token shaded by its KL.
"""

from __future__ import annotations

import base64
import html
import statistics
from pathlib import Path

from opd.runs.diagnosis import diagnosis_html, reward_share
from opd.runs.figures import PHASES, distinct, gantt, line_figure, series, time_split
from opd.runs.metrics import read_jsonl
from opd.runs.resume import CONFIG_NAME, METRICS_NAME, SAMPLES_NAME, TIMING_NAME

LEGEND = ((0.1, "0.1"), (0.5, "0.5"), (1.0, "1"), (2.0, "2+ nats"))
STYLE = """
body { font-family: system-ui, sans-serif; margin: 2rem auto; max-width: 1100px; color: #222; }
h1 { font-size: 1.6rem; } h2 { font-size: 1.2rem; margin-top: 2rem; border-bottom: 1px solid #ddd; }
.grid { display: grid; grid-template-columns: 1fr 1fr; gap: 1rem; }
figure { margin: 0; } figure img { width: 100%; border: 1px solid #eee; }
figcaption { font-size: .85rem; color: #555; }
table { border-collapse: collapse; width: 100%; font-size: .9rem; }
td, th { border: 1px solid #ddd; padding: .35rem .5rem; vertical-align: top; text-align: left; }
.summary td:first-child { font-weight: 600; width: 30%; }
.prompt { white-space: pre-wrap; color: #666; font-family: ui-monospace, monospace; }
.completion { white-space: pre-wrap; font-family: ui-monospace, monospace; }
.legend span { padding: 0 .4rem; }
"""


def _kl_colour(kl: float) -> str:
    """White at 0 nats, deep red from 2 nats up; blue-ish for negative estimates."""
    if kl < 0:
        strength = min(-kl / 2.0, 1.0)
        return f"rgba(76, 114, 176, {0.35 * strength:.2f})"
    return f"rgba(214, 39, 40, {min(kl / 2.0, 1.0) * 0.6:.2f})"


def _sample_rows(samples: list[dict], steps: list[int]) -> str:
    rows = []
    for sample in samples:
        if sample["step"] not in steps:
            continue
        if sample["token_kl"] is None:  # an SFT step: no teacher scores
            tokens, mean_kl = html.escape("".join(sample["tokens"])), "-"
        else:
            tokens = "".join(
                f'<span style="background:{_kl_colour(kl)}" title="KL '
                f'{kl:.3f}">{html.escape(token)}</span>'
                for token, kl in zip(sample["tokens"], sample["token_kl"], strict=True)
            )
            mean_kl = f"{sum(sample['token_kl']) / max(len(sample['token_kl']), 1):.3f}"
        rows.append(
            f"<tr><td>{sample['step']}</td><td>{html.escape(sample['dataset'])}</td>"
            f'<td class="prompt">{html.escape(sample["prompt"])}</td><td '
            f'class="completion">{tokens}</td>'
            f"<td>{mean_kl}</td></tr>"
        )
    return "\n".join(rows)


def _embed(path: Path | None, caption: str) -> str:
    if path is None:
        return ""
    data = base64.b64encode(path.read_bytes()).decode()
    caption = html.escape(caption)
    return (
        f'<figure><img src="data:image/png;base64,{data}" alt="{caption}">'
        f"<figcaption>{caption}</figcaption></figure>"
    )


def build_report(
    run_dir: str | Path, out: str | Path | None = None, sample_steps: list[int] | None = None
) -> Path:
    """Write ``report.html`` (and ``report_files/*.png``) for a run; returns the HTML path."""
    run_dir = Path(run_dir)
    metrics_path = run_dir / METRICS_NAME
    if not metrics_path.exists():
        raise FileNotFoundError(
            f"{run_dir}: no {METRICS_NAME}; is this a run directory (a log_path)?"
        )
    rows = read_jsonl(metrics_path)
    out = Path(out) if out else run_dir / "report.html"
    figures = out.parent / f"{out.stem}_files"
    figures.mkdir(parents=True, exist_ok=True)
    keys = sorted({key for row in rows for key in row})
    train_rows = [row for row in rows if "loss" in row]

    split = ("teacher_kl/answer", "teacher_kl/reasoning")
    kl_curves = distinct(
        {
            key: series(train_rows, key)
            for key in keys
            if key.startswith("teacher_kl") and key not in split
        }
    )
    share_rows = [{"step": row["step"], "reward_share": reward_share(row)} for row in train_rows]
    group_curves = {
        key: series(train_rows, key) for key in ("group/distinct", "reward/constant_groups")
    }
    reward_keys = sorted(
        (k for k in keys if k.startswith("reward/")), key=lambda k: k != "reward/mean"
    )
    reward_curves = {
        key: series(train_rows, key) for key in reward_keys
    }  # the mean drawn, not its twin
    reward_curves = distinct(
        {k: v for k, v in reward_curves.items() if k not in group_curves and "kept" not in k}
    )
    reward_curves["reward share of the advantage"] = series(share_rows, "reward_share")
    split_curves = {key: series(train_rows, key) for key in split}
    teacher_view = {
        key: series(train_rows, key)
        for key in ("diag/first_wrong_teacher_prob", "teacher/topk_mass")
    }
    objective_curves = {
        key: series(train_rows, key) for key in keys if key.startswith("objective/")
    }
    accuracy_curves = {
        key: series(rows, key) for key in keys if key.endswith(("/accuracy", "/pass@1"))
    }
    test_kl_curves = {
        key: series(rows, key)
        for key in keys
        if key.startswith("test/") and key.endswith("/teacher_kl")
    }
    health_curves = {
        key: series(train_rows, key)
        for key in ("entropy", "kl_sample_train", "post_kl")
        if key in keys
    }
    spans = read_jsonl(run_dir / TIMING_NAME)
    step_totals = [row["time/total"] for row in train_rows if "time/total" in row]
    typical = None
    if step_totals:
        median = statistics.median_low(step_totals)
        typical = next(row["step"] for row in train_rows if row.get("time/total") == median)

    sections = [
        (
            "Teacher KL (training batches)",
            line_figure(
                "teacher KL per token", kl_curves, "nats / token", figures / "teacher_kl.png"
            ),
        ),
        (
            "Objective",
            line_figure(
                "objective per token", objective_curves, "loss / token", figures / "objective.png"
            ),
        ),
        (
            "Held-out accuracy",
            line_figure(
                "held-out accuracy", accuracy_curves, "fraction correct", figures / "accuracy.png"
            ),
        ),
        (
            "Held-out teacher KL",
            line_figure(
                "held-out teacher KL",
                test_kl_curves,
                "nats / token",
                figures / "test_teacher_kl.png",
            ),
        ),
        (
            "Entropy and health checks",
            line_figure(
                "student entropy, sampler-trainer KL",
                health_curves,
                "nats / token",
                figures / "health.png",
            ),
        ),
        (
            "Group diversity",
            line_figure("samples of a prompt", group_curves, "share", figures / "groups.png"),
        ),
        (
            "Reward",
            line_figure(
                "the task's reward", reward_curves, "reward / share", figures / "reward.png"
            ),
        ),
        (
            "Teacher KL at the answer and before it",
            line_figure(
                "teacher KL: answer vs the rest",
                split_curves,
                "nats / token",
                figures / "split.png",
            ),
        ),
        (
            "The teacher's view of the student's tokens",
            line_figure(
                "teacher probabilities", teacher_view, "probability", figures / "teacher_view.png"
            ),
        ),
        ("Time per phase", time_split(train_rows, figures / "time_split.png")),
        (
            f"Timeline of step {typical} (median duration)",
            gantt(spans, typical, figures / "gantt.png") if typical is not None else None,
        ),
    ]
    samples_path = run_dir / SAMPLES_NAME
    samples = read_jsonl(samples_path)
    sample_step_set = sorted({s["step"] for s in samples})
    if sample_steps is None and sample_step_set:
        sample_steps = sorted(
            {sample_step_set[0], sample_step_set[len(sample_step_set) // 2], sample_step_set[-1]}
        )
    summary = _summary(run_dir, rows, train_rows)
    body = [
        f"<h1>opd run report: {html.escape(run_dir.name)}</h1>",
        "<h2>Summary</h2>",
        f'<table class="summary">{summary}</table>',
        "<h2>Why it went as it did</h2>",
        diagnosis_html(rows, _recorded_config(run_dir)),
        "<h2>Curves</h2>",
        '<div class="grid">' + "".join(_embed(path, title) for title, path in sections) + "</div>",
        "<h2>Sample completions</h2>",
        '<p class="legend">Each completion token is shaded by its sampled reverse KL to the '
        "teacher: "
        + "".join(f'<span style="background:{_kl_colour(v)}">{label}</span>' for v, label in LEGEND)
        + "; hover a token for its value. Each value is the sampled estimate log "
        "p<sub>student</sub> &minus; log p<sub>teacher</sub> of one token: negative where the "
        "teacher likes the token more than the student does, so a sample's mean can be below zero; "
        "averaged over many samples it estimates the KL, which never is.</p>",
        "<table><tr><th>step</th><th>dataset</th><th>prompt</th><th>completion</th><th>mean "
        "KL</th></tr>" + _sample_rows(samples, sample_steps or []) + "</table>",
    ]
    title = f"opd report: {html.escape(run_dir.name)}"
    head = f'<head><meta charset="utf-8"><title>{title}</title><style>{STYLE}</style></head>'
    out.write_text(
        f'<!doctype html><html lang="en">{head}<body>{"".join(body)}</body></html>',
        encoding="utf-8",
    )
    return out


def _recorded_config(run_dir: Path) -> dict:
    """The run's ``config.yaml`` (empty when it has none)."""
    import yaml

    path = run_dir / CONFIG_NAME
    config = yaml.safe_load(path.read_text()) if path.exists() else {}
    return config if isinstance(config, dict) else {}


def _objective_text(objective) -> str:
    """``name (option value, ...)`` of an objective as a run's config records it."""
    if not isinstance(objective, dict):
        return str(objective)
    options = ", ".join(f"{k} {v}" for k, v in objective.items() if k != "name")
    return (
        f"{objective.get('name', '?')} ({options})" if options else str(objective.get("name", "?"))
    )


def _summary(run_dir: Path, rows: list[dict], train_rows: list[dict]) -> str:
    config = _recorded_config(run_dir)
    training = config.get("training") or {}
    objective = _objective_text(training.get("objective", "?"))
    if training.get("off_policy_objective"):
        objective += f"; on the teacher's steps {_objective_text(training['off_policy_objective'])}"
    facts = {
        "student": (config.get("student") or {}).get("model", "?"),
        "teacher": (config.get("teacher") or {}).get("model", "?"),
        "objective / data": f"{objective} / {training.get('data_source', '?')}",
        "steps trained": str(len(train_rows)),
    }
    series = [row["teacher_kl"] for row in train_rows if row.get("teacher_kl") is not None]
    if series:
        facts["teacher_kl on the training batches (the student's samples): first step, last"] = (
            f"{series[0]:.4f} &rarr; {series[-1]:.4f}"
        )
    for key in sorted(
        {
            k
            for row in rows
            for k in row
            if k.startswith("test/") and k.endswith(("/accuracy", "/teacher_kl"))
        }
    ):
        series = [row[key] for row in rows if row.get(key) is not None]
        sizes = [
            row[key.rsplit("/", 1)[0] + "/num_prompts"]
            for row in rows
            if key.rsplit("/", 1)[0] + "/num_prompts" in row
        ]
        held_out = f"{sizes[-1]} held-out prompts" if sizes else "the held-out prompts"
        how = "greedy" if key.endswith("/accuracy") else "sampled"
        shown = (
            f"{series[0]:.1%} &rarr; {series[-1]:.1%}"
            if key.endswith("/accuracy")
            else f"{series[0]:.4f} &rarr; {series[-1]:.4f}"
        )
        facts[f"{key} ({held_out}, {how}): first evaluation, last"] = shown
    totals = {phase: sum(row.get(f"time/{phase}") or 0.0 for row in rows) for phase in PHASES}
    overall = sum(totals.values())
    if overall:
        facts["time split"] = ", ".join(
            f"{p} {100 * t / overall:.0f}%" for p, t in totals.items() if t
        )
    return "".join(
        f"<tr><td>{html.escape(k)}</td><td>{v if '&rarr;' in v else html.escape(v)}</td></tr>"
        for k, v in facts.items()
    )
