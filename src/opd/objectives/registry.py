"""Every objective opd knows, found by loading each module of :mod:`opd.objectives` once."""

from __future__ import annotations

import importlib
import pkgutil
from functools import cache

import opd.objectives
from opd.objectives.base import REGISTRY, Objective

DEFAULT = "sampled_reverse_kl"
"""The objective of the reference recipe, listed first."""


@cache
def objectives() -> dict[str, type[Objective]]:
    """Name -> objective class for every registered objective: the default first, then by name."""
    for module in pkgutil.iter_modules(opd.objectives.__path__):
        importlib.import_module(f"opd.objectives.{module.name}")
    return {
        name: REGISTRY[name] for name in sorted(REGISTRY, key=lambda name: (name != DEFAULT, name))
    }


def objective_names(**having) -> list[str]:
    """The registered names, in order; ``having`` keeps those whose class attributes match."""
    return [
        name
        for name, cls in objectives().items()
        if all(getattr(cls, attribute) == value for attribute, value in having.items())
    ]
