"""Range checks that every config section runs on its own fields: one wording for all of them, so a
user reads the same sentence whichever section is at fault."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable, Iterator
from typing import Any


def range_problems(
    section: Any, positive: Iterable[str] = (), non_negative: Iterable[str] = ()
) -> Iterator[tuple[str, str]]:
    """``(field, problem)`` for each named field of ``section`` out of range (None is unset: no
    problem)."""
    for names, allow_zero in ((positive, False), (non_negative, True)):
        for name in names:
            value = getattr(section, name)
            if value is not None and (value < 0 or (value == 0 and not allow_zero)):
                yield name, f"must be {'>= 0' if allow_zero else '> 0'}, got {value}"


def positive_arg(kind: type[int] | type[float]) -> Callable[[str], int | float]:
    """An argparse type that refuses zero and negatives (the demo would build its models first)."""

    def parse(text: str) -> int | float:
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its "invalid int value" message
    return parse
