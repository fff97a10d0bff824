"""The whole run's config: the top-level keys and the sections under them."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Literal

from opd.checks import range_problems
from opd.config.datasets import DatasetConfig
from opd.config.training import TrainingConfig
from opd.locations import missing_path_problem
from opd.sampling.engines import StudentSection
from opd.teachers.config import TeacherConfig

RUN_CONFIG_NAME = "config.yaml"
"""The resolved config a run writes in its ``log_path``."""


@dataclass
class Config:
    """A whole run: where it logs, what trains on what, and how."""

    student: StudentSection
    """The model being trained, and the engine that samples its rollouts."""
    teacher: TeacherConfig
    """The default teacher, used by every dataset that names none."""
    datasets: list[DatasetConfig]
    """Prompt sources; each step draws from all of them."""
    log_path: str = "runs/default"
    """Directory for metrics, config and checkpoints."""
    seed: int = 0
    """Seeds data order, sampling and initialisation."""
    save_every: int = 20
    """Checkpoint every N steps (0: only at the end); the end of the run always saves."""
    eval_every: int = 20
    """Evaluate on held-out prompts before every N-th step and after the last (0: never)."""
    on_existing_log_path: Literal["resume", "overwrite", "fail"] = "resume"
    """When ``log_path`` already holds a run: continue from its last checkpoint, start over, or
    stop."""
    load_checkpoint_path: str | None = None
    """Start a new run from these weights (a checkpoint or model directory) with a fresh
    optimizer."""
    loggers: list[Literal["tensorboard", "wandb", "mlflow"]] = field(default_factory=list)
    """Where metrics go besides ``metrics.jsonl`` (each needs its package installed)."""
    run_name: str | None = None
    """Run name shown by W&B and MLflow (default: the log_path's folder name)."""
    wandb_project: str | None = None
    """W&B project; the API key is read by wandb from ``WANDB_API_KEY``, never by opd."""
    mlflow_tracking_uri: str | None = None
    """MLflow tracking server or store; default ``<log_path>/mlruns``."""
    trace: bool = False
    """Also write ``trace.json`` (Chrome / Perfetto trace of every phase) at the end of the run."""
    compute_post_kl: bool = False
    """Log ``post_kl``: KL between the policy before and after the step's update, on the step's
    batch."""
    training: TrainingConfig = field(default_factory=TrainingConfig)
    """The optimisation loop."""

    def problems(self) -> Iterator[tuple[str, str]]:
        """``(field, problem)`` for the top level's own fields (the sections check theirs)."""
        if not self.datasets:
            yield "datasets", "at least one dataset is required"
        names = [d.name for d in self.datasets]
        repeated = {n for n in names if names.count(n) > 1}
        if repeated:
            yield "datasets", f"names must be unique; repeated: {sorted(repeated)}"
        if self.load_checkpoint_path and (
            problem := missing_path_problem(self.load_checkpoint_path)
        ):
            yield "load_checkpoint_path", problem
        yield from range_problems(self, non_negative=("save_every", "eval_every"))

    def teacher_sections(self) -> list[tuple[str, TeacherConfig]]:
        """Each ``teacher`` section with the config key it is set at (a mixture as one)."""
        return [("teacher", self.teacher)] + [
            (f"datasets[{i}].teacher", d.teacher) for i, d in enumerate(self.datasets) if d.teacher
        ]

    def teachers(self) -> list[tuple[str, TeacherConfig]]:
        """Each teacher with the config key it is set at, a mixture's members one by one."""
        return [
            (where if t.mixture is None else f"{where}.mixture[{j}]", member)
            for where, t in self.teacher_sections()
            for j, (member, _) in enumerate(t.members)
        ]

    def teacher_for(self, dataset: DatasetConfig) -> TeacherConfig:
        """The teacher that scores ``dataset``."""
        return dataset.teacher or self.teacher
