"""A ``datasets`` entry: one prompt source, its grader, its environment, and the checks of its own
fields (a table's options, the sizes)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

from opd.checks import range_problems
from opd.data.graders import MATH_VERIFY_INSTALL, math_verify_available
from opd.data.tables import PROMPT_KEYS, is_table_source
from opd.envs.registry import EnvConfig
from opd.teachers.config import TeacherConfig


@dataclass
class DatasetConfig:
    """One prompt source. Every step takes ``groups_per_batch`` prompts from each dataset."""

    name: str
    """Used in metric names (``teacher_kl/<name>``) and example printouts."""
    source: str
    """A JSONL file: one ``{"prompt": ...}`` or ``{"messages": [...]}`` object per line,
    optionally with an ``answer``; ``demo:<task>`` or ``reasoning_gym:<task>`` for a generated
    task; or a table: ``hf:<owner>/<name>`` (a Hugging Face dataset, streamed), a directory
    written by ``datasets``' ``save_to_disk``, or a ``.parquet`` file (see ``split``,
    ``fields``)."""
    groups_per_batch: int | None = None
    """Prompts per step from this dataset (unset: 16 samples a step, ``16 / group_size``
    prompts)."""
    group_size: int | None = None
    """Samples drawn per prompt (unset: 1, or 4 when the task's reward is in the advantage,
    ``training.reward_coef`` > 0, which centres each reward in its prompt's group). One sample of
    each of 16 prompts learns more per step than 4 of each of 4 (docs/quality.md)."""
    teacher: TeacherConfig | None = None
    """A teacher for this dataset only; defaults to the top-level ``teacher``."""
    num_prompts: int | None = None
    """Use only the first N prompts of a file, or generate N for a generated source (default
    2000)."""
    task_config: dict[str, Any] = field(default_factory=dict)
    """Options of a ``reasoning_gym:<task>`` generator, e.g. ``{min_terms: 2, max_terms: 2}``."""
    eval_source: str | None = None
    """Held-out prompts; defaults to the ``@test`` split of a generated source, to ``eval_split`` of
    a dataset's table, none for files."""
    eval_num_prompts: int = 64
    """Held-out prompts used per evaluation."""
    split: str = "train"
    """Tables (``hf:<owner>/<name>``, a ``save_to_disk`` directory, a Parquet file): the split
    prompts come from."""
    eval_split: str | None = None
    """Tables: the split held-out prompts come from (of ``eval_source``, else of ``source``)."""
    subset: str | None = None
    """``hf:`` datasets with several configurations: which one (``main`` for ``openai/gsm8k``)."""
    fields: dict[str, str] = field(default_factory=dict)
    """Tables: the column each prompt key is read from, e.g. ``{prompt: question, answer: answer}``
    (keys: ``prompt`` or ``messages``, ``answer``, ``completion``, ``metadata``); unmapped keys are
    read from columns of their own name."""
    grader: Literal[
        "auto", "exact_match", "last_number", "reasoning_gym", "math_verify", "none"
    ] = "auto"
    """How answers are scored: ``auto`` is the task's scorer for reasoning-gym, exact match
    otherwise; ``last_number`` compares the last number written; ``math_verify`` compares answers as
    mathematics (LaTeX, ``\\boxed{}``, fractions, sets: Hugging Face's Math-Verify, ``pip install
    'opd[math]'``). Held-out accuracy is the share graded 1; with ``training.reward_coef`` > 0 the
    grade of each sample is its reward."""
    env: EnvConfig | None = None
    """Multi-turn episodes: the environment that answers each student turn (a tool's result, a
    user's reply) until the episode ends: ``calculator``, ``retry`` or ``my_pkg.envs:MyEnv``, with
    ``max_turns``, ``max_episode_tokens`` and its own options beside the name
    (docs/environments.md). The teacher scores only the student's turns. Unset: one turn per
    prompt."""

    def problems(self) -> Iterator[tuple[str, str]]:
        """``(field, problem)`` for this dataset's own fields."""
        for key in ("groups_per_batch", "group_size"):
            value = getattr(self, key)
            if value is not None and value < 1:
                yield key, f"must be >= 1, got {value}"
        yield from range_problems(self, positive=("num_prompts", "eval_num_prompts"))
        if self.grader == "math_verify" and not math_verify_available():
            missing = "'math_verify' needs the math-verify package, which is not installed"
            yield "grader", f"{missing}; {MATH_VERIFY_INSTALL}"
        yield from table_option_problems(self)


def table_option_problems(dataset: DatasetConfig) -> list[tuple[str, str]]:
    """``(field, problem)`` for table options that cannot apply: a key no prompt has, or options
    given for a source that is no table."""
    problems = [
        (f"fields.{key}", f"not a prompt key; use {', '.join(PROMPT_KEYS)}")
        for key in dataset.fields
        if key not in PROMPT_KEYS
    ]
    if not any(is_table_source(s) for s in (dataset.source, dataset.eval_source) if s):
        given = [key for key in ("fields", "subset", "eval_split") if getattr(dataset, key)]
        given += ["split"] if dataset.split != "train" else []
        problems += [
            (key, "applies to tables (hf:<dataset>, a save_to_disk directory, a .parquet file), "
                  "and "
             f"'{dataset.source}' is none")
            for key in given
        ]  # fmt: skip
    return problems
