"""Typed parsing: a plain mapping (as YAML gives it) into the config's dataclasses, each value
checked against its annotation, each section's own checks run as it is built, so an error names
its dotted path (``training.learning_rate``, ``datasets[0].teacher.base_url``)."""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from typing import Any, Literal

from opd.envs.registry import EnvConfig, parse_env_config
from opd.errors import ConfigError
from opd.objectives.base import Objective
from opd.objectives.registry import objective_names, objectives


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


MAX_INT = 2**63 - 1
"""Larger integers are a typo, and would overflow where torch or numpy meet them."""


def coerce(value: Any, tp: Any, path: str) -> Any:
    """Check ``value`` against the annotation ``tp`` (ints widen to floats) and build
    dataclasses."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(tp)
        if value is None and type(None) in options:
            return None
        errors, section_errors = [], []
        for option in (o for o in options if o is not type(None)):
            try:
                return coerce(value, option, path)
            except ConfigError as error:
                errors.append(str(error))
                if isinstance(value, dict) and dataclasses.is_dataclass(option):
                    section_errors.append(
                        str(error)
                    )  # a mapping meant as this section: its own error
        if len(section_errors) == 1:
            raise ConfigError(section_errors[0])
        raise ConfigError(
            errors[0] if len(errors) == 1 else f"{path}: {value!r} matches none of {tp}"
        )
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            hint = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
            suggestion = f" (did you mean {hint[0]!r}?)" if hint else ""
            raise ConfigError(f"{path}: {value!r} is not one of {list(choices)}{suggestion}")
        return value
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{path}: expected a list, got {type(value).__name__} {value!r}")
        (item_type,) = typing.get_args(tp)
        return [coerce(item, item_type, f"{path}[{i}]") for i, item in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a mapping, got {type(value).__name__} {value!r}")
        _, value_type = typing.get_args(tp)
        return {str(k): coerce(v, value_type, f"{path}.{k}") for k, v in value.items()}
    if tp is Objective:
        return build_objective(value, path)
    if tp is EnvConfig:
        return parse_env_config(value, path)
    if dataclasses.is_dataclass(tp):
        return build_dataclass(tp, value, path)
    if tp is Any:
        return value
    if tp is float and isinstance(value, int | float | str) and not isinstance(value, bool):
        try:
            number = float(value)  # YAML 1.1 reads 3e-5 (no dot) as a string
        except (ValueError, OverflowError):
            raise ConfigError(
                f"{path}: expected float, got {type(value).__name__} {value!r}"
            ) from None
        if not math.isfinite(number):
            raise ConfigError(f"{path}: must be a finite number, got {value!r}")
        return number
    if tp is bool and not isinstance(value, bool):
        raise ConfigError(f"{path}: expected true or false, got {value!r}")
    if tp is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise ConfigError(f"{path}: expected an integer, got {value!r}")
    if tp is int and abs(value) > MAX_INT:
        raise ConfigError(f"{path}: {value} is too large (at most {MAX_INT})")
    if not isinstance(value, tp):
        raise ConfigError(
            f"{path}: expected {_type_name(tp)}, got {type(value).__name__} {value!r}"
        )
    return value


def _option_owners(key: str) -> list[str]:
    """The registered objectives that have an option called ``key``."""
    return [
        name
        for name, cls in objectives().items()
        if key in {f.name for f in dataclasses.fields(cls)}
    ]


def build_dataclass(cls: type, data: Any, path: str) -> Any:
    """``cls`` from a mapping: unknown keys named (with a close spelling, or the objective they
    belong to), each value typed, then the section's own ``problems()`` raised with their dotted
    path."""
    prefix = f"{path}." if path else ""
    if not isinstance(data, dict):
        raise ConfigError(
            f"{path or 'config'}: expected a mapping, got {type(data).__name__} {data!r}"
        )
    hints = typing.get_type_hints(cls)
    known = [f.name for f in dataclasses.fields(cls)]
    unknown = [key for key in data if key not in known]
    if unknown:
        key = unknown[0]
        section = next(
            (name for name in known if Objective in (hints[name], *typing.get_args(hints[name]))),
            None,
        )
        owners = _option_owners(str(key)) if section else []
        if owners:
            raise ConfigError(
                f"{prefix}{key}: an option of objective {' or '.join(map(repr, owners))}, set "
                f"under {prefix}{section}: e.g. {section}: {{name: {owners[0]}, {key}: "
                f"{data[key]!r}}}"
            )
        hint = difflib.get_close_matches(str(key), known, n=1)
        suggestion = (
            f"; did you mean '{prefix}{hint[0]}'?" if hint else f"; known keys: {', '.join(known)}"
        )
        raise ConfigError(f"{prefix}{key}: unknown key{suggestion}")
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name in data:
            kwargs[f.name] = coerce(data[f.name], hints[f.name], f"{prefix}{f.name}")
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(f"{prefix}{f.name}: required key is missing")
    built = cls(**kwargs)
    for key, problem in getattr(built, "problems", lambda: ())():
        raise ConfigError(f"{prefix}{key}: {problem}")
    return built


def build_objective(value: Any, path: str) -> Objective:
    """An objective from its name, or from ``{name: ..., option: value, ...}``."""
    if isinstance(value, str):
        name, options = value, {}
    elif isinstance(value, dict):
        if "name" not in value:
            raise ConfigError(f"{path}.name: required key is missing (one of {objective_names()})")
        name, options = value["name"], {k: v for k, v in value.items() if k != "name"}
    else:
        raise ConfigError(
            f"{path}: expected an objective's name or a mapping {{name: ..., options}}, got "
            f"{value!r}"
        )
    registered = objectives()
    if not isinstance(name, str) or name not in registered:
        hint = difflib.get_close_matches(str(name), list(registered), n=1)
        suggestion = f" (did you mean {hint[0]!r}?)" if hint else ""
        raise ConfigError(f"{path}: {name!r} is not one of {list(registered)}{suggestion}")
    cls = registered[name]
    own = [f.name for f in dataclasses.fields(cls)]
    for key in options:
        owners = _option_owners(str(key))
        if key not in own and owners:
            raise ConfigError(
                f"{path}.{key}: an option of objective {' or '.join(map(repr, owners))}, not of "
                f"{name!r} (its options: {', '.join(own) or 'none'})"
            )
    objective = build_dataclass(cls, options, path)
    for option, problem in objective.option_problems():
        raise ConfigError(f"{path}.{option}: {problem}")
    return objective
