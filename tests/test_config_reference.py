"""docs/config.md is the config as the code declares it, every key documented; ``opd config``
prints a config with every default filled in, which reads back as the same config; ``opd
--version`` says the installed version."""

from __future__ import annotations

import dataclasses
from importlib.metadata import version
from pathlib import Path

import pytest
import yaml

from opd.cli import main
from opd.config import config_from_dict, config_to_dict
from opd.config_reference import SECTIONS, field_docs, render
from opd.objectives.registry import objectives

REFERENCE = Path(__file__).parents[1] / "docs" / "config.md"


def test_the_reference_is_current():
    assert REFERENCE.read_text() == render(), (
        "regenerate: python -m opd.config_reference > docs/config.md"
    )


def test_every_key_is_documented_where_it_is_declared():
    classes = [cls for _, cls, _ in SECTIONS] + list(objectives().values())
    undocumented = [
        f"{cls.__name__}.{field.name}"
        for cls in classes
        for field in dataclasses.fields(cls)
        if field.init and field.name not in field_docs(cls)
    ]
    assert undocumented == []


def test_every_key_of_a_resolved_config_is_in_the_reference(base_config):
    text = REFERENCE.read_text()
    resolved = config_to_dict(config_from_dict(base_config))
    keys = [
        f"`{key}`" for key in resolved if key not in ("student", "teacher", "datasets", "training")
    ]
    keys += [
        f"`{section}.{key}`"
        for section in ("student", "teacher", "training")
        for key in resolved[section]
    ]
    keys += [f"`datasets[].{key}`" for key in resolved["datasets"][0]]
    assert [key for key in keys if key not in text] == []


def test_opd_config_prints_every_default_and_reads_back_as_the_same_config(
    base_config, tmp_path, capsys
):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(base_config))
    assert main(["config", str(path), "training.max_steps=7"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["training"]["max_steps"] == 7
    assert printed["training"]["warmup_steps"] == 0  # a default the file does not set
    assert printed["student"]["sampler"] == "hf"
    expected = config_to_dict(config_from_dict(base_config, ["training.max_steps=7"]))
    assert config_to_dict(config_from_dict(printed)) == expected


def test_opd_version(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.strip() == f"opd {version('opd')}"
