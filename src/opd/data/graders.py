"""Graders: how a completion is scored against a prompt's reference answer, in [0, 1]."""

from __future__ import annotations

import re
from collections.abc import Callable
from functools import cache

from opd.data.prompts import Prompt

Grader = Callable[[str, Prompt], float]
NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


def exact_match(completion: str, prompt: Prompt) -> float:
    """1.0 when the completion, stripped of surrounding whitespace, is exactly the answer."""
    return float(completion.strip() == (prompt.answer or "").strip())


def last_number(text: str) -> float | None:
    """The last number written in ``text`` (thousands separators allowed), or None."""
    found = NUMBER.findall(text)
    if not found:
        return None
    try:
        return float(found[-1].replace(",", ""))
    except ValueError:
        return None


def last_number_match(completion: str, prompt: Prompt) -> float:
    """1.0 when the last number in the completion equals the answer's number."""
    expected, got = last_number(prompt.answer or ""), last_number(completion)
    return float(expected is not None and got is not None and abs(expected - got) < 1e-9)


@cache
def _reasoning_gym_scorer(task: str):
    import reasoning_gym

    return reasoning_gym.create_dataset(task, size=1, seed=0).score_answer


def reasoning_gym_score(completion: str, prompt: Prompt) -> float:
    """The task's own scorer, from ``reasoning-gym``, on the entry the prompt was generated from.

    The entry comes from a ``reasoning_gym:`` source or a JSONL record's ``metadata``.
    """
    entry = prompt.metadata
    if not entry or "metadata" not in entry or "source_dataset" not in entry["metadata"]:
        raise ValueError(
            "the reasoning_gym grader needs prompts from a reasoning_gym: source, or JSONL records "
            "whose 'metadata' is the reasoning-gym entry ({question, answer, metadata})"
        )
    from reasoning_gym.utils import extract_answer

    scorer = _reasoning_gym_scorer(entry["metadata"]["source_dataset"])
    tagged = extract_answer(completion)  # the last <answer>...</answer>, reasoning-gym's own convention
    return float(scorer(answer=completion if tagged is None else tagged, entry=entry))


GRADERS: dict[str, Grader] = {
    "exact_match": exact_match,
    "last_number": last_number_match,
    "reasoning_gym": reasoning_gym_score,
}


def grader_for(name: str, source: str) -> Grader | None:
    """Resolve ``auto``: the task's scorer for reasoning-gym sources, else exact match; ``none`` is None."""
    if name == "none":
        return None
    if name == "auto":
        return reasoning_gym_score if source.startswith("reasoning_gym:") else exact_match
    return GRADERS[name]


def grader_of(name: str, source: str, prompts: list[Prompt]) -> Grader | None:
    """The grader for a dataset's prompts: :func:`grader_for`, or None when some prompt has no
    answer to grade against (reasoning-gym graders read the entry instead)."""
    grader = grader_for(name, source)
    if grader is not None and name != "reasoning_gym" and any(p.answer is None for p in prompts):
        return None
    return grader
