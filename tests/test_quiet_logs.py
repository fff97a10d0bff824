"""A real run's stderr holds opd's own lines and bar only: no third-party bar or cursor escape
(transformers' "Loading weights" and "Writing model shards"), written to a file or to a terminal
alike, unless ``--verbose``."""

from __future__ import annotations

import fcntl
import os
import pty
import struct
import subprocess
import sys
import termios

import pytest
import yaml

from opd.cli import QUIET

THIRD_PARTY = ("Loading weights", "Writing model shards", "\x1b[A")
CLEAN = {key: value for key, value in os.environ.items() if key not in QUIET}
"""This environment less what an earlier ``opd`` command in the test process set (as a user's
shell)."""


def command(config_path, *flags: str) -> list[str]:
    return [sys.executable, "-m", "opd", "train", str(config_path), "save_every=1", *flags]


def to_a_file(argv: list[str], tmp_path) -> str:
    with open(tmp_path / "stderr.log", "w") as stderr:
        done = subprocess.run(
            argv, stdout=subprocess.DEVNULL, stderr=stderr, timeout=300, env=CLEAN
        )
    text = (tmp_path / "stderr.log").read_text()
    assert done.returncode == 0, text[-2000:]
    return text


def to_a_terminal(argv: list[str]) -> str:
    """The run's stderr on a pseudo-terminal, as a user's shell shows it."""
    reader, writer = pty.openpty()
    fcntl.ioctl(
        writer, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0)
    )  # 24 rows, 100 columns
    process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=writer, env=CLEAN)
    os.close(writer)
    chunks = []
    while True:
        try:
            chunk = os.read(reader, 65536)
        except OSError:  # the terminal closed with the process
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(reader)
    assert process.wait(timeout=300) == 0
    return b"".join(chunks).decode(errors="replace")


@pytest.fixture
def config_path(base_config, tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(base_config))
    return path


def test_a_run_written_to_a_file_has_no_third_party_bars(config_path, tmp_path):
    quiet = to_a_file(command(config_path, "--no-progress"), tmp_path)
    assert "opd: loading the student" in quiet
    assert [text for text in THIRD_PARTY if text in quiet] == []
    config_path.write_text(config_path.read_text().replace("/run", "/verbose"))
    loud = to_a_file(command(config_path, "--no-progress", "--verbose"), tmp_path)
    assert "Loading weights" in loud and "Writing model shards" in loud  # what --verbose keeps


def test_a_run_on_a_terminal_shows_opd_s_bar_and_no_third_party_bars(config_path):
    shown = to_a_terminal(command(config_path))
    assert "opd |" in shown and "2/2" in shown  # opd's own bar, to its end
    assert [text for text in THIRD_PARTY if text in shown] == []


def test_a_lora_run_prints_no_third_party_warning(config_path, tmp_path):
    """peft reads a transformers property that transformers 5.2x deprecates: a FutureWarning on
    every LoRA run, which opd keeps off the console (the run's own warnings still show)."""
    text = to_a_file(command(config_path, "--no-progress", "student.lora_rank=4"), tmp_path)
    assert "opd: loading the student" in text
    assert "Warning" not in text, text[-2000:]
