"""``opd eval``: evaluate a run's student on its datasets' held-out prompts."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from opd.config import ConfigError, config_from_dict
from opd.runs.checkpoints import latest_model_dir
from opd.runs.resume import CONFIG_NAME, load_student_weights
from opd.trainer.loop import Trainer

RESULTS_NAME = "eval.jsonl"


def evaluate_run(run_dir: str | Path, *, checkpoint: str | Path | None = None, base: bool = False) -> dict:
    """``test/*`` metrics of the latest checkpoint (or ``checkpoint``, or the untrained student).

    The result is printed by the CLI and appended to ``<run_dir>/eval.jsonl``.
    """
    run_dir = Path(run_dir)
    config_file = run_dir / CONFIG_NAME
    if not config_file.exists():
        raise ConfigError(f"{run_dir}: no {CONFIG_NAME}; is this a run directory (a log_path)?")
    config = config_from_dict(yaml.safe_load(config_file.read_text()))
    trainer = Trainer(config, progress=False)
    if not trainer.eval_sets:
        raise ConfigError(
            "datasets: no held-out prompts; set datasets[i].eval_source "
            "(generated sources have a @test split)"
        )
    model_dir = None if base else Path(checkpoint) if checkpoint else latest_model_dir(run_dir)
    if model_dir is not None:
        load_student_weights(trainer.student, model_dir)
    metrics = trainer.evaluate()
    record = {"model": str(model_dir) if model_dir else config.student.model} | metrics
    with (run_dir / RESULTS_NAME).open("a", encoding="utf-8") as handle:
        handle.write(json.dumps(record) + "\n")
    return record
