"""What SECURITY.md promises, checked: secrets masked wherever a run records or prints a config or
a URL, no unsafe deserialisation or remote code in the source, servers on loopback by default."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import yaml

from opd.cli import build_parser
from opd.secrets import redact, redact_values

SOURCE = Path(__file__).resolve().parents[1] / "src" / "opd"


def test_redact_masks_url_credentials_and_secret_query_parameters():
    assert redact("https://alice:s3cret@host:8000/v1") == "https://***@host:8000/v1"
    assert redact("http://tok@h/v1 and ftp://u:p@x") == "http://***@h/v1 and ftp://***@x"
    assert (
        redact("https://h/v1?api_key=abc&x=1&token=def#f")
        == "https://h/v1?api_key=***&x=1&token=***#f"
    )
    assert (
        redact("http://127.0.0.1:8000/v1") == "http://127.0.0.1:8000/v1"
    )  # nothing secret: unchanged
    assert redact("user@example.com wrote a@b") == "user@example.com wrote a@b"  # not a URL
    nested = {"a": ["https://u:p@h"], "b": {"c": "https://h?key=k"}, "d": 3}
    assert redact_values(nested) == {
        "a": ["https://***@h"],
        "b": {"c": "https://h?key=***"},
        "d": 3,
    }


def test_a_secret_in_a_teacher_url_is_in_no_file_and_no_message(base_config, tmp_path):
    secret = "pa55w0rd-do-not-leak"
    config = dict(
        base_config,
        teacher={
            "model": "t",
            "backend": "openai",
            "base_url": f"http://admin:{secret}@127.0.0.1:9/v1?api_key={secret}",
            "tokenizer": base_config["teacher"]["model"],
            "max_retries": 0,
            "timeout_s": 2,
        },
    )
    path = tmp_path / "leaky.yaml"
    # refused by the replica probe before the run starts; with the probe off, at the first step,
    # after the run wrote its config
    for probes in (4, 0):
        config["teacher"]["replica_probes"] = probes
        path.write_text(yaml.safe_dump(config))
        result = subprocess.run(
            [sys.executable, "-m", "opd", "train", str(path), "--no-progress"],
            capture_output=True,
            text=True,
        )
        assert result.returncode == 2
        assert "opd: error: teacher server http://***@127.0.0.1:9/v1?api_key=***" in result.stderr
        assert secret not in result.stderr + result.stdout
    written = [p for p in (tmp_path / "run").rglob("*") if p.is_file()]
    assert any(p.name == "config.yaml" for p in written)
    for file in written:
        assert secret.encode() not in file.read_bytes(), file


def source_lines(pattern: str) -> list[str]:
    found = []
    for file in SOURCE.rglob("*.py"):
        for number, line in enumerate(file.read_text().splitlines(), start=1):
            if re.search(pattern, line):
                found.append(f"{file.relative_to(SOURCE)}:{number}: {line.strip()}")
    return found


def test_no_unsafe_deserialisation_or_remote_code_in_the_source():
    torch_loads = source_lines(r"torch\.load\(")
    assert torch_loads and all("weights_only=True" in line for line in torch_loads), torch_loads
    assert (
        source_lines(
            r"\bimport pickle\b|pickle\.loads?\(|\bmarshal\.|yaml\.load\(|yaml\.unsafe_load"
        )
        == []
    )
    assert source_lines(r"trust_remote_code\s*=\s*True") == []
    assert source_lines(r"shell\s*=\s*True|os\.system\(|(?<![.\w])eval\(|(?<![.\w])exec\(") == []


def test_servers_and_launches_bind_loopback_by_default():
    serve = build_parser().parse_args(["serve", "some/model"])
    assert serve.host == "127.0.0.1"
    assert source_lines(r"0\.0\.0\.0") == []


def test_an_environment_by_import_path_is_imported_when_the_config_is_read(base_config, tmp_path):
    """SECURITY.md: a config naming an environment by import path runs that module's code as soon
    as the config is checked, ``opd config`` included (nothing else in a config imports code)."""
    package = tmp_path / "pkg"
    package.mkdir()
    marker = tmp_path / "imported"
    (package / "user_env.py").write_text(
        f"from pathlib import Path\nPath({str(marker)!r}).write_text('ran')\nclass Env:\n    def "
        "start(self, prompt, grader):\n        raise NotImplementedError\n"
    )
    plain = tmp_path / "plain.yaml"
    plain.write_text(yaml.safe_dump(base_config))
    env = {"PYTHONPATH": str(package), "PATH": "/usr/bin:/bin"}
    checked = subprocess.run(
        [sys.executable, "-m", "opd", "config", str(plain)], capture_output=True, env=env
    )
    assert checked.returncode == 0 and not marker.exists()
    base_config["datasets"][0]["env"] = {"name": "user_env:Env"}
    named = tmp_path / "named.yaml"
    named.write_text(yaml.safe_dump(base_config))
    checked = subprocess.run(
        [sys.executable, "-m", "opd", "config", str(named)], capture_output=True, env=env
    )
    assert checked.returncode == 0, checked.stderr
    assert marker.read_text() == "ran"


def test_hub_datasets_are_read_without_remote_code():
    """No ``trust_remote_code`` reaches ``datasets``: a hub dataset's loading script never runs."""
    tables = (SOURCE / "data" / "tables.py").read_text()
    assert "load_dataset(" in tables and "trust_remote_code" not in tables


def test_every_test_security_md_names_exists():
    """Each promise is backed by the tests it names: a renamed or removed test breaks this one."""
    root = SOURCE.parents[1]
    text = (root / "SECURITY.md").read_text()
    named = re.findall(r"`(tests\w*/\w+\.py)::(\w+)`", text)
    named += [
        (file, name)
        for file, group in re.findall(r"`(tests\w*/\w+\.py)` \(([^)]*)\)", text)
        for name in re.findall(r"`(test_\w+)`", group)
    ]
    assert len(named) >= 15
    missing = [
        f"{file}::{name}" for file, name in named if f"def {name}(" not in (root / file).read_text()
    ]
    assert missing == []
