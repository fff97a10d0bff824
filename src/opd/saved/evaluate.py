"""``opd eval``: evaluate a run's student on its datasets' held-out prompts.

Only what evaluation needs is built: the student (with the checkpoint's weights), a sampler of
it, and the teachers that score its samples; no optimizer, training data or rollout engine.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import yaml

from opd.assemble.eval_sets import eval_source_of, load_eval_sets
from opd.assemble.student import load_student
from opd.assemble.teachers import load_teachers
from opd.config import ConfigError, config_from_dict
from opd.runs.checkpoints import latest_model_dir
from opd.runs.evaluation import evaluate
from opd.runs.resume import CONFIG_NAME
from opd.runs.sharded_state import load_checkpoint_weights

RESULTS_NAME = "eval.jsonl"


def evaluate_run(
    run_dir: str | Path, *, checkpoint: str | Path | None = None, base: bool = False
) -> dict:
    """``test/*`` metrics of the latest checkpoint (or ``checkpoint``, or the untrained student).

    The result is printed by the CLI and appended to ``<run_dir>/eval.jsonl``.
    """
    run_dir = Path(run_dir)
    config_file = run_dir / CONFIG_NAME
    if not config_file.exists():
        raise ConfigError(f"{run_dir}: no {CONFIG_NAME}; is this a run directory (a log_path)?")
    config = config_from_dict(yaml.safe_load(config_file.read_text()))
    if not any(eval_source_of(d)[0] for d in config.datasets):
        raise ConfigError(
            "datasets: no held-out prompts; set datasets[i].eval_source (generated sources have a "
            "@test split)"
        )
    model_dir = None if base else Path(checkpoint) if checkpoint else latest_model_dir(run_dir)
    student = load_student(config)
    if model_dir is not None:
        load_checkpoint_weights(student.policy, model_dir)
    sampler = student.sampler_for(student.policy.model)
    teachers = load_teachers(config, student, sampler.pad_id, None)
    started = time.perf_counter()
    metrics = evaluate(
        sampler,
        student.renderer,
        load_eval_sets(config, teachers.logprobs),
        temperature=config.training.temperature,
        max_tokens=config.training.max_tokens,
        seed=config.seed,
        pad_id=sampler.pad_id,
    )
    record = {"model": str(model_dir) if model_dir else config.student.model}
    record |= metrics | {"time/eval": time.perf_counter() - started}
    with (run_dir / RESULTS_NAME).open("a", encoding="utf-8") as handle:
        handle.write(json.dumps(record) + "\n")
    return record
