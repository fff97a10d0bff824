"""Every environment opd knows (each module of :mod:`opd.envs` loaded once), a user's own by
import path, and a dataset's ``env`` setting checked and turned into its environment."""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import pkgutil
import typing
from dataclasses import dataclass, field
from functools import cache
from typing import Any, Literal

import opd.envs
from opd.envs.base import REGISTRY, Environment
from opd.errors import ConfigError

SETTINGS = ("name", "max_turns", "max_episode_tokens", "step_workers")
"""The keys of ``env`` that every environment has; the others are its own options."""


@dataclass(frozen=True)
class EnvConfig:
    """A dataset's environment: ``env: {name: calculator, max_turns: 4, <its options>}``."""

    name: str
    """A registered environment (``calculator``, ``retry``) or a class by import path,
    ``my_pkg.envs:MyEnv``."""
    max_turns: int = 4
    """Student turns per episode at most; an episode still going after them ends as cut."""
    max_episode_tokens: int | None = None
    """Tokens after the first prompt, the student's and the environment's, at most (unset: twice
    ``max_turns`` x ``training.max_tokens``: room for replies as long as the turns); an episode
    that would pass it ends as cut. Micro-batches are sized to hold a whole episode."""
    step_workers: int = 1
    """Episodes whose answers are awaited at once: up to this many of this environment's ``step``
    calls run together, each in a thread of their own, while the student's other turns are sampled
    (1: one at a time, in the trainer's thread). For an environment whose step waits on a tool (a
    sandbox, a web API) and that is safe to call from several threads, each for its own episode;
    the episodes played are the same token for token."""
    options: dict[str, Any] = field(default_factory=dict)
    """The environment's own options, written beside ``name`` in the config."""

    def mapping(self) -> dict[str, Any]:
        """As a config writes it: the settings and the options side by side."""
        return {
            "name": self.name,
            "max_turns": self.max_turns,
            "max_episode_tokens": self.max_episode_tokens,
            "step_workers": self.step_workers,
            **self.options,
        }

    def episode_tokens(self, max_tokens: int) -> int:
        """The episode's token budget, given ``training.max_tokens`` per turn."""
        return self.max_episode_tokens or 2 * self.max_turns * max_tokens


@cache
def environments() -> dict[str, type[Environment]]:
    """Name -> class for every registered environment, by name."""
    for module in pkgutil.iter_modules(opd.envs.__path__):
        importlib.import_module(f"opd.envs.{module.name}")
    return dict(sorted(REGISTRY.items()))


def environment_class(name: str, path: str) -> type:
    """The class ``name`` means: a registered name, or ``module:Class`` (``module.Class``)."""
    registered = environments()
    if name in registered:
        return registered[name]
    if ":" not in name and "." not in name:
        hint = difflib.get_close_matches(name, list(registered), n=1)
        suggestion = f" (did you mean {hint[0]!r}?)" if hint else ""
        raise ConfigError(
            f"{path}: {name!r} is not a registered environment{suggestion}; registered: "
            f"{list(registered)}, or give a class by import path, e.g. my_pkg.envs:MyEnv"
        )
    module_name, _, attribute = name.partition(":") if ":" in name else name.rpartition(".")
    try:
        module = importlib.import_module(module_name)
    except Exception as error:
        raise ConfigError(
            f"{path}: cannot import module {module_name!r} for {name!r}: {type(error).__name__}: "
            f"{error}"
        ) from None
    cls = getattr(module, attribute, None)
    if not isinstance(cls, type) or not callable(getattr(cls, "start", None)):
        found = (
            "no such name"
            if cls is None
            else f"{type(cls).__name__}, not a class with a start(prompt, grader) method"
        )
        raise ConfigError(f"{path}: {module_name}.{attribute}: {found}")
    return cls


def _check_option(key: str, value: Any, hint: Any, path: str) -> None:
    if typing.get_origin(hint) is Literal:
        if value not in typing.get_args(hint):
            raise ConfigError(
                f"{path}.{key}: {value!r} is not one of {list(typing.get_args(hint))}"
            )
        return
    expected = {int: (int,), float: (int, float), bool: (bool,), str: (str,)}.get(hint)
    if expected and (
        not isinstance(value, expected) or (hint is not bool and isinstance(value, bool))
    ):
        raise ConfigError(f"{path}.{key}: expected {hint.__name__}, got {value!r}")


def make_environment(config: EnvConfig, path: str = "env") -> Environment:
    """The environment ``config`` names, built with its options (each checked, named by field)."""
    cls = environment_class(config.name, f"{path}.name")
    if dataclasses.is_dataclass(cls):
        known = {f.name: f for f in dataclasses.fields(cls)}
        hints = typing.get_type_hints(cls)
        for key, value in config.options.items():
            if key not in known:
                listed = ", ".join(known) or "none"
                raise ConfigError(
                    f"{path}.{key}: not an option of environment {config.name!r} (its options: "
                    f"{listed})"
                )
            _check_option(key, value, hints[key], path)
    try:
        environment = cls(**config.options)
    except (TypeError, ValueError) as error:
        raise ConfigError(
            f"{path}: environment {config.name!r} refused its options: {error}"
        ) from None
    for option, problem in getattr(environment, "option_problems", lambda: iter(()))():
        raise ConfigError(f"{path}.{option}: {problem}")
    return environment


def parse_env_config(value: Any, path: str) -> EnvConfig:
    """``env: calculator`` or ``env: {name: ..., max_turns: ..., <options>}``, checked now (the
    environment is built once, so a bad option or import path stops the run before any work)."""
    if isinstance(value, str):
        value = {"name": value}
    if not isinstance(value, dict):
        raise ConfigError(
            f"{path}: expected an environment's name or a mapping {{name: ..., options}}, got "
            f"{value!r}"
        )
    if "name" not in value or not isinstance(value["name"], str):
        raise ConfigError(
            f"{path}.name: required, a registered environment ({list(environments())}) or "
            "module:Class"
        )
    options = dict(value.get("options") or {})
    options |= {k: v for k, v in value.items() if k not in (*SETTINGS, "options")}
    limits = {key: value[key] for key in SETTINGS[1:] if key in value}
    for key, limit in limits.items():
        if (limit is not None or key != "max_episode_tokens") and (
            isinstance(limit, bool) or not isinstance(limit, int) or limit < 1
        ):
            raise ConfigError(f"{path}.{key}: must be an integer >= 1, got {limit!r}")
    config = EnvConfig(value["name"], options=options, **limits)
    make_environment(config, path)
    return config
