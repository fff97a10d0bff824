"""Where models come from, and the places a config names, checked before any work: a local path
missing (with the close match and the config file), a device or server URL torch or HTTP cannot
use, a YAML slip (file:line:column), and a hub id on a machine without the hub: refused in
seconds with the fix when it is not cached, loaded from the cache when it is."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from opd.cli import main
from tests.servers import free_port


def write(config: dict, path: Path) -> Path:
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            "student.device=gpu",
            "student.device: 'gpu' is not a device; use auto, cpu, cuda, cuda:N or mps",
        ),
        ("teacher.device=cuda0", "teacher.device: 'cuda0' is not a device"),
        (
            "teacher={model: t, backend: openai, base_url: 'localhost:8000/v1'}",
            "teacher.base_url: 'localhost:8000/v1' is not an http(s) URL with a host",
        ),
        (
            "teacher={model: t, backend: openai, base_url: 'http://h:80a/v1'}",
            "teacher.base_url: 'http://h:80a/v1' has a port that is not a number",
        ),
    ],
)
def test_a_place_that_cannot_work_is_named_with_the_config_file_before_any_work(
    base_config, tmp_path, capsys, override, message
):
    path = write(base_config, tmp_path / "run.yaml")
    assert main(["train", str(path), override]) == 2
    assert capsys.readouterr().err.startswith(f"opd: error: {path}: {message}")
    assert not (tmp_path / "run").exists()


def test_a_missing_model_path_names_the_file_and_the_close_match(base_config, tmp_path, capsys):
    real = Path(base_config["student"]["model"])
    base_config["student"]["model"] = str(real.with_name(real.name + "s"))  # .../students
    path = write(base_config, tmp_path / "run.yaml")
    assert main(["train", str(path)]) == 2
    assert capsys.readouterr().err.strip() == (
        f"opd: error: {path}: student.model: path '{real}s' does not exist; did you mean '{real}'?"
    )


def test_a_yaml_slip_is_named_by_file_line_and_column(tmp_path, capsys):
    path = tmp_path / "run.yaml"
    path.write_text("student:\n  model: x\n  lora_rank: [1\nteacher: {model: y}\n")
    assert main(["train", str(path)]) == 2
    assert capsys.readouterr().err.strip() == (
        f"opd: error: {path}:4:8: not valid YAML: expected ',' or ']', but got ':' (while parsing "
        "a flow sequence opened at line 3, column 14)"
    )


def hub_cached(model_dir: Path, cache: Path, repo: str) -> None:
    """``model_dir`` laid out as huggingface_hub's cache holds a downloaded ``repo``."""
    snapshot = cache / f"models--{repo.replace('/', '--')}" / "snapshots" / ("0" * 40)
    shutil.copytree(model_dir, snapshot)
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("0" * 40)


def train_offline(
    config: Path, cache: Path, hub: str, *overrides: str
) -> subprocess.CompletedProcess:
    """``opd train`` where the hub's address ``hub`` takes no connection."""
    env = os.environ | {
        "HF_ENDPOINT": hub,
        "HF_HUB_CACHE": str(cache),
        "OMP_NUM_THREADS": "1",
    }
    for key in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        env.pop(key, None)
    command = [sys.executable, "-m", "opd", "train", str(config), "--no-progress", *overrides]
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)


def test_a_hub_id_without_the_hub_loads_from_the_cache_and_fails_with_the_fix_when_not_cached(
    base_config, model_dirs, tmp_path
):
    cache = tmp_path / "hub-cache"
    hub_cached(model_dirs["student"], cache, "someone/tiny-student")
    base_config["student"]["model"] = "someone/tiny-student"
    base_config["training"]["max_steps"] = 1
    config = write(base_config, tmp_path / "run.yaml")
    hub = f"http://127.0.0.1:{free_port()}"  # a closed port: no connection, as without network
    cached = train_offline(config, cache, hub)
    assert cached.returncode == 0, cached.stderr[-2000:]
    assert (tmp_path / "run" / "metrics.jsonl").is_file()

    missing = train_offline(
        config, cache, hub, "student.model=someone/elsewhere", f"log_path={tmp_path / 'other'}"
    )
    assert missing.returncode == 2
    assert missing.stderr.strip().splitlines()[-1] == (
        "opd: error: student.model: 'someone/elsewhere' is not a local path, this machine cannot "
        f"reach the Hugging Face hub ({hub}), and it is not in the Hugging Face cache. Give a "
        "local directory (download it where there is network: huggingface-cli download "
        "someone/elsewhere --local-dir DIR), or with it cached set HF_HUB_OFFLINE=1"
    )
    assert "Traceback" not in missing.stderr
