"""Deciding where a run starts: fresh, resumed from its last checkpoint, or from given weights."""

from __future__ import annotations

import json
import math
import os
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path

import yaml

from opd.config import RUN_CONFIG_NAME as CONFIG_NAME
from opd.config import Config, ConfigError, recorded_config
from opd.runs.checkpoints import INDEX_NAME, list_checkpoints, load_trainer_state

METRICS_NAME = "metrics.jsonl"
SAMPLES_NAME = "samples.jsonl"
TIMING_NAME = "timing.jsonl"
RUN_FILES = (
    CONFIG_NAME,
    METRICS_NAME,
    INDEX_NAME,
    TIMING_NAME,
    SAMPLES_NAME,
    "trace.json",
    "eval.jsonl",
    "checkpoints",
)
# Changing these between a run and its resumption would train a different run.
RESUME_CRITICAL = (
    "seed",
    "student.model",
    "student.tokenizer",
    "student.lora_rank",
    "student.lora_alpha",
    "student.lora_target_modules",
    "student.chat_template",
    "datasets",
    "training.data_source",
)


@dataclass
class StartPoint:
    """Where :meth:`Trainer.run` begins."""

    step: int = 0
    trainer_state: dict | None = None
    model_dir: Path | None = None


def _lookup(data: dict, dotted: str):
    node = data
    for part in dotted.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


def check_resumable(saved: dict, config: Config) -> None:
    """Refuse to resume when a field that defines the run changed; name the field."""
    current = recorded_config(config)
    for field in RESUME_CRITICAL:
        if _lookup(saved, field) != _lookup(current, field):
            raise ConfigError(
                f"{field}: differs from the run being resumed in {config.log_path} "
                f"({_lookup(saved, field)!r} there, {_lookup(current, field)!r} now). Use another "
                "log_path, or on_existing_log_path: overwrite to start over."
            )


def _is_empty_run(log_path: Path) -> bool:
    return not any((log_path / name).exists() for name in RUN_FILES)


def resumed_model_dir(config: Config) -> Path | None:
    """The weights a run would resume from (None: it starts fresh); read only, nothing checked."""
    log_path = Path(config.log_path)
    if not log_path.is_dir() or _is_empty_run(log_path) or config.on_existing_log_path != "resume":
        return None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # resume_point warns, when the run starts
        records = list_checkpoints(log_path)
    return records[-1].path / "model" if records else None


def resume_point(config: Config) -> StartPoint:
    """Where the run starts, as ``on_existing_log_path`` decides it: read only, nothing written."""
    log_path = Path(config.log_path)
    if log_path.exists() and not log_path.is_dir():
        raise ConfigError(f"log_path: '{log_path}' exists and is not a directory")
    if (
        not log_path.exists()
        or _is_empty_run(log_path)
        or config.on_existing_log_path == "overwrite"
    ):
        return StartPoint()
    if config.on_existing_log_path == "fail":
        raise ConfigError(
            f"log_path: '{log_path}' already holds a run and on_existing_log_path is 'fail'; "
            "choose another log_path, or resume / overwrite"
        )
    saved_config = log_path / CONFIG_NAME
    if saved_config.exists():
        check_resumable(yaml.safe_load(saved_config.read_text()) or {}, config)
    records = list_checkpoints(log_path)
    if not records:
        warnings.warn(f"{log_path} has no complete checkpoint: starting from step 0", stacklevel=2)
        return StartPoint()
    last = records[-1]
    state = load_trainer_state(last, records[:-1])
    return StartPoint(step=last.step, trainer_state=state, model_dir=last.path / "model")


def prepare_log_path(config: Config) -> None:
    """Create ``log_path``, or empty it under ``on_existing_log_path: overwrite`` (once nothing can
    fail)."""
    log_path = Path(config.log_path)
    if log_path.exists() and not log_path.is_dir():
        raise ConfigError(f"log_path: '{log_path}' exists and is not a directory")
    log_path.mkdir(parents=True, exist_ok=True)
    if not os.access(log_path, os.W_OK):
        raise ConfigError(f"log_path: '{log_path}' is not writable")
    if config.on_existing_log_path == "overwrite" and not _is_empty_run(log_path):
        for name in RUN_FILES:
            target = log_path / name
            if target.is_dir():
                shutil.rmtree(target)
            elif target.exists():
                target.unlink()


def keep_metrics_before(path: Path, step: int) -> None:
    """Drop JSONL rows of steps at or after ``step`` (they will be redone), atomically."""
    if not path.exists():
        return
    kept = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    kept = [line for line in kept if _step_of(line) < step]
    staging = path.with_suffix(".tmp")
    staging.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
    staging.replace(path)


def _step_of(line: str) -> float:
    """A JSONL row's step; a row torn by a crash mid-write counts as after every step (dropped,
    redone)."""
    try:
        return json.loads(line).get("step", -1)
    except (json.JSONDecodeError, AttributeError):
        return math.inf
