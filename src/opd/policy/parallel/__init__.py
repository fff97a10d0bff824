"""Every parallel mode opd knows (``training.parallel``), found by loading each module of this
package once. A new mode is one module here: a :class:`ParallelMode` subclass with its ``name``."""

from __future__ import annotations

import importlib
import pkgutil
from functools import cache

from opd.policy.parallel.base import REGISTRY, ParallelMode

AUTO_SEVERAL = "fsdp"
"""What ``training.parallel: auto`` is with several processes (with one: ``none``)."""


@cache
def parallel_modes() -> dict[str, type[ParallelMode]]:
    """Name -> mode class for every registered mode, ``none`` first."""
    for module in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{module.name}")
    return {
        name: REGISTRY[name] for name in sorted(REGISTRY, key=lambda name: (name != "none", name))
    }


def parallel_mode(name: str) -> ParallelMode:
    """The mode ``training.parallel`` names (resolved: not ``auto``)."""
    return parallel_modes()[name]()


__all__ = ["AUTO_SEVERAL", "ParallelMode", "parallel_mode", "parallel_modes"]
