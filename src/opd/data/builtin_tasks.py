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


def _arithmetic(rng: random.Random) -> tuple[str, str]:
    terms = [rng.randint(100, 9999) for _ in range(rng.randint(2, 3))]
    signs = [rng.choice("+-") for _ in terms[1:]]
    expression = str(terms[0]) + "".join(
        f"{sign}{term}" for sign, term in zip(signs, terms[1:], strict=True)
    )
    total = terms[0] + sum(
        term if sign == "+" else -term for sign, term in zip(signs, terms[1:], strict=True)
    )
    return f"compute {expression}", str(total)


TASKS: dict[str, Task] = {
    "arithmetic": Task(
        "add and subtract 2-3 numbers of 3-4 digits (the calculator environment's task)",
        _arithmetic,
    ),
    "reverse": Task("reverse a word of 3-6 letters a-h", _reverse),
    "sort_digits": Task("sort 3-6 digits ascending", _sort_digits),
}


def generate_task_prompts(
    spec: str, *, seed: int, count: int = DEFAULT_NUM_PROMPTS
) -> list[Prompt]:
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
