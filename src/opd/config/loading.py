"""Reading a config: YAML text, ``dotted.key=value`` overrides, the typed build, the rules; and
writing one back (``config.yaml`` of a run, ``opd config``) so that it reads back equal."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from typing import Any

import yaml

from opd.config.defaults import objective_mapping
from opd.config.parsing import build_dataclass
from opd.config.rules import validate
from opd.config.run import Config
from opd.errors import ConfigError
from opd.secrets import redact_values


def parse_override(override: str) -> tuple[list[str], Any]:
    """``a.b.c=value`` -> (["a", "b", "c"], YAML-parsed value)."""
    if "=" not in override:
        raise ConfigError(f"override {override!r}: expected dotted.key=value")
    key, raw = override.split("=", 1)
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {override!r}: empty key part")
    try:
        value = yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError as error:
        raise ConfigError(f"override {override!r}: value is not valid YAML ({error})") from error
    return key.split("."), value


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Set each ``dotted.key=value``; list elements are addressed by index (``datasets.0.name``)."""
    for override in overrides:
        parts, value = parse_override(override)
        node: Any = data
        for depth, part in enumerate(parts[:-1]):
            where = ".".join(parts[: depth + 1])
            if isinstance(node, list):
                if not part.isdigit() or int(part) >= len(node):
                    raise ConfigError(f"override {override!r}: {where} is not an index of the list")
                node = node[int(part)]
            else:
                if node.get(part) is None:
                    node[part] = {}
                node = node[part]
            if not isinstance(node, dict | list):
                raise ConfigError(f"override {override!r}: {where} is a value, not a section")
        last = parts[-1]
        if isinstance(node, list):
            if not last.isdigit() or int(last) >= len(node):
                raise ConfigError(f"override {override!r}: {last} is not an index of the list")
            node[int(last)] = value
        else:
            node[last] = value
    return data


def config_from_dict(data: dict, overrides: list[str] | None = None) -> Config:
    """Validate a plain mapping (as read from YAML) into a :class:`Config`."""
    data = _objective_as_mapping(copy.deepcopy(data))
    for override in overrides or []:
        data = _objective_as_mapping(apply_overrides(data, [override]))
    return validate(build_dataclass(Config, data, ""))


def _objective_as_mapping(data: dict) -> dict:
    """``training.objective: jsd`` as ``{name: jsd}``, so that ``training.objective.beta=...``
    applies."""
    training = data.get("training")
    for key in ("objective", "off_policy_objective"):
        if isinstance(training, dict) and isinstance(training.get(key), str):
            training[key] = {"name": training[key]}
    return data


def load_config(path: str | Path, overrides: list[str] | None = None) -> Config:
    """Read a YAML config file, apply dotted overrides, validate."""
    path = Path(path)
    try:
        found = path.is_file()
    except (OSError, ValueError) as error:  # a name no file can have (too long, a NUL byte)
        raise ConfigError(
            f"{str(path)[:80]}...: not a file name this system can open ({error})"[:300]
        ) from None
    if not found:
        raise ConfigError(f"{path}: config file not found")
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as error:
        raise ConfigError(
            f"{path}: not UTF-8 text (byte {error.object[error.start]:#04x} at offset "
            f"{error.start}); save the config as UTF-8"
        ) from None
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as error:
        raise ConfigError(_yaml_problem(path, error)) from None
    except RecursionError:
        raise ConfigError(f"{path}: not a config: nested too deeply for YAML to read") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of keys")
    try:
        return config_from_dict(data, overrides)
    except ConfigError as error:
        raise ConfigError(f"{path}: {error}") from error


def _yaml_problem(path: Path, error: yaml.YAMLError) -> str:
    """``file:line:column: not valid YAML: what the parser expected``, as compilers put it."""
    mark = getattr(error, "problem_mark", None)
    where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
    problem = getattr(error, "problem", None) or str(error)
    context, opened = getattr(error, "context", None), getattr(error, "context_mark", None)
    if context and opened is not None:
        context += f" opened at line {opened.line + 1}, column {opened.column + 1}"
    return f"{where}: not valid YAML: {problem}" + (f" ({context})" if context else "")


def recorded_config(config: Config) -> dict:
    """The config as a run records it (``config.yaml``, W&B, MLflow): credentials in URLs masked."""
    return redact_values(config_to_dict(config))


def config_to_dict(config: Config) -> dict:
    """A plain mapping that :func:`config_from_dict` turns back into an equal config."""
    data = dataclasses.asdict(config)
    data["training"]["objective"] = objective_mapping(config.training.objective)
    if config.training.off_policy_objective is not None:
        data["training"]["off_policy_objective"] = objective_mapping(
            config.training.off_policy_objective
        )
    for dataset, written in zip(config.datasets, data["datasets"], strict=True):
        if dataset.env is not None:
            written["env"] = dataset.env.mapping()
    return data
