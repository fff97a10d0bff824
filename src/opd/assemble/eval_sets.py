"""A run's held-out sets built from its config: each dataset's held-out prompts (an ``eval_source``,
a generated ``@test`` split, or a table's ``eval_split``), how they are graded, its environment and
how its teacher scores them."""

from __future__ import annotations

import torch

from opd.config import Config, DatasetConfig
from opd.data.graders import grader_of
from opd.data.sequences import RolloutBatch
from opd.data.sources import load_prompts
from opd.data.tables import TableOptions, is_table_source
from opd.envs.base import Environment
from opd.envs.registry import make_environment
from opd.runs.evaluation import EvalSet, TeacherScorer
from opd.teachers.base import Teacher, TeacherInput, TeacherRequest


def direct_scorer(teacher: Teacher) -> TeacherScorer:
    """A scorer for a teacher that reads the student's token ids as they are."""

    def score(batch: RolloutBatch) -> torch.Tensor:
        inputs = TeacherInput(batch.input_ids_BT, batch.attention_mask_BT, batch.mask_BT.bool())
        return teacher.score(inputs, TeacherRequest()).logprobs_BT

    return score


def default_eval_source(source: str) -> str | None:
    """Generated sources have a held-out ``@test`` split; files need an explicit ``eval_source``."""
    if source.startswith(("demo:", "reasoning_gym:")) and "@" not in source:
        return f"{source}@test"
    return None


def eval_source_of(dataset: DatasetConfig) -> tuple[str | None, TableOptions]:
    """Where a dataset's held-out prompts come from: ``eval_source``, its generated ``@test``
    split, or ``eval_split`` of its table; and which split and columns of a table to read."""
    split = dataset.eval_split or dataset.split
    options = TableOptions(split, dataset.subset, dataset.fields)
    if dataset.eval_source:
        return dataset.eval_source, options
    if dataset.eval_split and is_table_source(dataset.source):
        return dataset.source, options
    return default_eval_source(dataset.source), options


def load_eval_sets(
    config: Config,
    score: TeacherScorer | None,
    environments: list[Environment | None] | None = None,
) -> list[EvalSet]:
    """Every dataset's held-out prompts (where it has any), graded when answers exist; each
    dataset's environment is the run's own when ``environments`` are handed over, else built
    here."""
    eval_sets = []
    for index, dataset in enumerate(config.datasets):
        source, table = eval_source_of(dataset)
        if source is None:
            continue
        prompts = load_prompts(
            source,
            seed=config.seed,
            count=dataset.eval_num_prompts,
            task_config=dataset.task_config,
            table=table,
        )[: dataset.eval_num_prompts]
        grader = grader_of(dataset.grader, source, prompts)
        if environments is not None:
            environment = environments[index]
        elif dataset.env is not None:
            environment = make_environment(dataset.env, f"datasets[{index}].env")
        else:
            environment = None
        eval_sets.append(
            EvalSet(dataset.name, index, prompts, grader, score, dataset.env, environment)
        )
    return eval_sets
