"""The config reference (docs/config.md), generated from the config dataclasses and the docstrings
under each of their fields, so the reference cannot drift from the code: a test compares the two.

    python -m opd.config_reference > docs/config.md
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import itertools
import re
import textwrap
import typing
from typing import Any

from opd.config import Config, DatasetConfig, LambdaSchedule, TrainingConfig
from opd.envs.registry import EnvConfig, environments
from opd.objectives.registry import objectives
from opd.objectives.rollout_correction import RolloutCorrection
from opd.sampling.engines import StudentSection
from opd.teachers.config import MixtureMember, TeacherConfig


def _first_line(cls: type) -> str:
    """A class docstring's first sentence, as one line."""
    return " ".join((cls.__doc__ or "").split()).replace("``", "`")


SECTIONS: list[tuple[str, type, str]] = [
    ("", Config, "The top level of a config file."),
    ("student", StudentSection, "The model being trained and the engine that samples it."),
    (
        "teacher",
        TeacherConfig,
        "The default teacher; a dataset's own `teacher:` takes the same keys.",
    ),
    (
        "teacher.mixture[]",
        MixtureMember,
        "Each teacher of a mixture: every `teacher` key above (but `mixture`), and its weight.",
    ),
    ("datasets[]", DatasetConfig, "Each entry of the `datasets` list."),
    (
        "datasets[].env",
        EnvConfig,
        "A dataset's environment (docs/environments.md): these keys and the environment's own "
        "options, side by side (`env: {name: calculator, max_turns: 3, result_role: user}`).",
    ),
    *(
        ("training", section, f"The optimisation loop: {_first_line(section)}")
        for section in reversed(TrainingConfig.__bases__)
    ),
    (
        "training.lmbda",
        LambdaSchedule,
        "`training.lmbda` as a schedule (`data_source: mixed`): a mapping of these keys instead of "
        "a number.",
    ),
    (
        "training.rollout_correction",
        RolloutCorrection,
        "`training.rollout_correction`: how the weight of tokens the sampler and the trainer "
        "disagree on is bounded (docs/objectives.md).",
    ),
]
NESTED = {"student", "teacher", "datasets", "training"}
"""Top-level keys documented in sections of their own."""


def field_docs(cls: type) -> dict[str, str]:
    """Each field's docstring (the string literal under its declaration), read from the source of
    the class and of the sections it is made of."""
    docs = {}
    for owner in reversed([c for c in cls.__mro__ if dataclasses.is_dataclass(c)]):
        docs |= _own_field_docs(owner)
    return docs


def _own_field_docs(cls: type) -> dict[str, str]:
    """The docstrings of the fields ``cls`` declares itself."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for declaration, following in itertools.pairwise(body):
        if (
            isinstance(declaration, ast.AnnAssign)
            and isinstance(declaration.target, ast.Name)
            and isinstance(following, ast.Expr)
            and isinstance(following.value, ast.Constant)
            and isinstance(following.value.value, str)
        ):
            docs[declaration.target.id] = " ".join(following.value.value.split()).replace("``", "`")
    return docs


def type_name(annotation: Any) -> str:
    """A field's type as a user writes its value."""
    if isinstance(annotation, str):
        return annotation
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Literal:
        return " \\| ".join(repr(arg).replace("'", "") for arg in args)
    if origin in (typing.Union, __import__("types").UnionType):
        return " \\| ".join("null" if arg is type(None) else type_name(arg) for arg in args)
    if origin is not None:
        inner = ", ".join(type_name(arg) for arg in args)
        return f"{getattr(origin, '__name__', str(origin))}[{inner}]"
    return getattr(annotation, "__name__", str(annotation))


def default_text(field: dataclasses.Field) -> str:
    if field.default is not dataclasses.MISSING:
        value = field.default
    elif field.default_factory is not dataclasses.MISSING:
        value = field.default_factory()
    else:
        return "required"
    if value == "":  # required unless another key stands for it (the docs say which)
        return "required"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if dataclasses.is_dataclass(value):
        return "(a section)"
    return f"`{value!r}`".replace("'", "") if not isinstance(value, str) else f"`{value}`"


def rows(prefix: str, cls: type) -> list[str]:
    docs = field_docs(cls)
    hints = typing.get_type_hints(cls)
    lines = ["| key | type | default | what it does |", "|---|---|---|---|"]
    documented = {cls for _, cls, _ in SECTIONS}
    inherited = {
        f.name for base in cls.__bases__ if base in documented for f in dataclasses.fields(base)
    }
    for field in dataclasses.fields(cls):
        if not field.init or (cls is Config and field.name in NESTED) or field.name in inherited:
            continue
        key = f"{prefix}.{field.name}" if prefix else field.name
        text = docs.get(field.name, "").replace("|", "\\|")
        lines.append(
            f"| `{key}` | {type_name(hints[field.name])} | {default_text(field)} | {text} |"
        )
    return lines


def component_sections(registered: dict[str, type]) -> list[str]:
    """A section per registered component (objective, environment): its docstring and its
    options."""
    out = []
    for name, cls in registered.items():
        doc = " ".join((cls.__doc__ or "").split()).replace("``", "`")
        out += ["", f"### {name}", "", doc]
        if any(field.init for field in dataclasses.fields(cls)):
            out += ["", *rows("", cls)]
    return out


def render() -> str:
    """docs/config.md: every key with its type, default and documentation."""
    out = [
        "# Config reference",
        "",
        "Every key of an `opd train` config, with its type, default and meaning. Set any of them "
        "in the",
        "YAML file or on the command line as a dotted override (`training.max_steps=5`,",
        "`datasets.0.group_size=8`); `opd config my.yaml` prints a config with every default "
        "filled",
        "in. Generated from the code (`python -m opd.config_reference > docs/config.md`); a test "
        "keeps",
        "it current.",
    ]
    for prefix, cls, intro in SECTIONS:
        title = prefix or "top level"
        if cls in TrainingConfig.__bases__:
            title += (
                ": "
                + re.sub(r"(?<!^)(?=[A-Z])", " ", cls.__name__.removesuffix("Settings")).lower()
            )
        out += ["", f"## {title}", "", intro, "", *rows(prefix, cls)]
    out += [
        "",
        "## training.objective options",
        "",
        "`training.objective` is a name, or `{name: ..., option: value}` with the options below",
        "(e.g. `objective: {name: jsd, beta: 0.9}`).",
    ]
    out += component_sections(objectives())
    out += [
        "",
        "## datasets[].env options",
        "",
        "Each registered environment's own options, written beside its name",
        "(`env: {name: retry, hint: true}`).",
    ]
    out += component_sections(environments())
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    print(render(), end="")
