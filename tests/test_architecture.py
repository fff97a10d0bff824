"""The house stays readable: no module over 350 lines, and every module and package of opd sits in
a layer of the import contract (``pyproject.toml``), so ``lint-imports`` covers new ones too."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "src" / "opd"
MOST_LINES = 350


def test_no_module_is_over_350_lines():
    sizes = {
        str(path.relative_to(SOURCE)): len(path.read_text(encoding="utf-8").splitlines())
        for path in SOURCE.rglob("*.py")
    }
    assert {name: lines for name, lines in sizes.items() if lines > MOST_LINES} == {}


def test_every_top_level_module_and_package_is_in_the_layers_contract():
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"][
        "contracts"
    ]
    layers = next(c for c in contracts if c["name"].startswith("Data flows one way"))["layers"]
    named = {part.strip() for layer in layers for part in layer.split("|")}
    present = {
        f"opd.{path.stem}"
        for path in SOURCE.iterdir()
        if (path.suffix == ".py" and path.stem not in ("__init__", "__main__"))
        or (path.is_dir() and (path / "__init__.py").exists())
    }
    assert present - named == set(), "add them to [tool.importlinter] layers in pyproject.toml"


def test_the_trainer_is_plain_parts_not_mixins():
    """No class of ``opd.trainer`` is built from two or more bases: what an object holds is read
    in its own ``__init__``, not in a method resolution order."""
    import ast

    mixed = [
        f"{path.name}:{node.name}"
        for path in (SOURCE / "trainer").glob("*.py")
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
        if isinstance(node, ast.ClassDef) and len(node.bases) > 1
    ]
    assert mixed == []
