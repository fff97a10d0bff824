"""Small generated tasks with checkable answers, for the demo and tests (no download)."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

from opd.data.prompts import DataError, Prompt

DEFAULT_NUM_PROMPTS = 2000


@dataclass(frozen=True)
class Task:
    """A generator of (question, answer) pairs."""

    description: str
    make: Callable[[random.Random], tuple[str, str]]


def _reverse(rng: random.Random) -> tuple[str, str]:
    word = "".join(rng.choice("abcdefgh") for _ in range(rng.randint(3, 6)))
    return f"reverse {word}", word[::-1]


def _sort_digits(rng: random.Random) -> tuple[str, str]:
    digits = "".join(rng.choice("0123456789") for _ in range(rng.randint(3, 6)))
    return f"sort {digits}", "".join(sorted(digits))


TASKS: dict[str, Task] = {
    "reverse": Task("reverse a word of 3-6 letters a-h", _reverse),
    "sort_digits": Task("sort 3-6 digits ascending", _sort_digits),
}


def generate_task_prompts(spec: str, *, seed: int, count: int = DEFAULT_NUM_PROMPTS) -> list[Prompt]:
    """``reverse`` or ``reverse@test`` (a held-out split drawn from another seed stream)."""
    name, _, split = spec.partition("@")
    if name not in TASKS:
        raise DataError(f"demo:{spec}: unknown built-in task; choose one of {sorted(TASKS)}")
    if split not in ("", "train", "test"):
        raise DataError(f"demo:{spec}: unknown split '{split}'; use @train or @test")
    rng = random.Random(f"{name}/{split or 'train'}/{seed}")
    prompts = []
    for _ in range(count):
        question, answer = TASKS[name].make(rng)
        prompts.append(Prompt(messages=({"role": "user", "content": question},), answer=answer))
    return prompts
