"""The README's code, as a new user would run it after `opd demo`: its Python example as written
(twice: a second call finds the run complete and must print the same), the demo's follow-up
commands, its config block (examples/demo.yaml), its prompt-file lines, and every `opd` command
in it and in the user guide (docs/guide.md) parsed by opd's own parser with its config
resolved (``my.yaml`` standing for the demo's config). Commands that need GPUs, vLLM or a
server are resolved, not run."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from opd.cli import build_parser
from opd.config import load_config
from opd.data.prompts import load_jsonl_prompts

ROOT = Path(__file__).parents[1]
README = (ROOT / "README.md").read_text()
GUIDE = (ROOT / "docs" / "guide.md").read_text()
"""The user guide the README points to: its commands are checked with the README's."""


def blocks(language: str, text: str = README) -> list[str]:
    """The fenced code blocks in ``language`` of ``text`` (the README), in order."""
    return re.findall(rf"^```{language}\n(.*?)^```$", text, flags=re.MULTILINE | re.DOTALL)


def opd_commands() -> list[list[str]]:
    """Every ``opd ...`` (or ``-m opd ...``) command line of the bash blocks of the README and the
    user guide, as argv after ``opd``."""
    commands = []
    for block in blocks("bash") + blocks("bash", GUIDE):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            for start, word in enumerate(words):
                if word == "opd" and (start == 0 or words[start - 1] in ("-m", "&&")):
                    commands.append(words[start + 1 :])
                    break
    return commands


@pytest.fixture
def new_user(demo_models, tmp_path):
    """A user's working copy after ``opd demo``: the demo's models in ~/.cache/opd, examples/
    here."""
    home = tmp_path / "home"
    (home / ".cache").mkdir(parents=True)
    (home / ".cache" / "opd").symlink_to(demo_models["cache"])
    work = tmp_path / "work"
    shutil.copytree(ROOT / "examples", work / "examples")
    env = {key: value for key, value in os.environ.items() if key != "OPD_CACHE"}
    return work, env | {"HOME": str(home), "OMP_NUM_THREADS": "1"}


def run(argv: list[str], work: Path, env: dict) -> subprocess.CompletedProcess:
    done = subprocess.run(argv, cwd=work, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{argv}:\n{done.stderr[-3000:]}"
    assert "Traceback" not in done.stderr
    return done


def test_the_python_example_runs_as_written_and_says_the_same_when_run_again(new_user):
    (code,) = blocks("python")
    work, env = new_user
    first = run([sys.executable, "-c", code], work, env)
    kl, accuracy = (float(value) for value in first.stdout.split())
    assert 0 < kl < 5 and 0 <= accuracy <= 1
    again = run([sys.executable, "-c", code], work, env)
    assert again.stdout == first.stdout
    assert "training already complete (50 steps)" in again.stderr


def test_the_demo_follow_up_commands_run(new_user):
    """``opd demo --steps 50 --log-path runs/short``, then report, export and eval on its run
    (the README shows them on runs/demo, the 400-step run `opd demo` makes)."""
    work, env = new_user
    (block,) = [b for b in blocks("bash") if "opd report runs/demo" in b]
    commands = [shlex.split(line, comments=True) for line in block.splitlines()]
    assert commands[2] == ["opd", "demo", "--steps", "50", "--log-path", "runs/short"]
    opd = [sys.executable, "-m", "opd"]
    run(opd + commands[2][1:], work, env)
    run([*opd, "report", "runs/short"], work, env)
    assert (work / "runs" / "short" / "report.html").is_file()
    run([*opd, "export", "runs/short", "student/"], work, env)
    assert (work / "student" / "config.json").is_file()
    evaluated = run([*opd, "eval", "runs/short"], work, env)
    assert "test/reverse/accuracy" in evaluated.stdout


def test_the_config_block_is_examples_demo_yaml():
    shown = next(block for block in blocks("yaml") if block.startswith("# examples/demo.yaml"))
    assert yaml.safe_load(shown) == yaml.safe_load((ROOT / "examples" / "demo.yaml").read_text())


def test_the_prompt_file_lines_are_prompts(tmp_path):
    (lines,) = blocks("json")
    path = tmp_path / "prompts.jsonl"
    path.write_text(lines)
    prompts = load_jsonl_prompts(path)
    assert [p.messages[-1]["content"] for p in prompts] == ["reverse abc", "Hi"]
    assert [p.answer for p in prompts] == ["cba", None]
    assert json.loads(lines.splitlines()[1])["messages"][0]["role"] == "system"


def samples_with_vllm(config: str) -> bool:
    """A README command's config whose student samples with an in-process vLLM: checking it needs
    vLLM installed, so the vLLM suite resolves it (tests_vllm/test_vllm_recipes.py)."""
    path = ROOT / config
    return path.is_file() and (yaml.safe_load(path.read_text())["student"].get("sampler") == "vllm")


def config_commands() -> list[tuple[str, list[str]]]:
    """The README's ``opd train`` / ``opd config`` commands: the config and its overrides."""
    parser = build_parser()
    found = []
    for argv in opd_commands():
        args, unparsed = parser.parse_known_args(argv)
        if args.command in ("train", "config"):
            overrides = [*args.overrides, *unparsed]
            assert all("=" in override for override in overrides), argv
            found.append((args.config, overrides))
        elif args.command != "rollout-server":
            assert not unparsed, argv
    return found


def test_every_opd_command_parses_and_its_config_resolves(new_user, monkeypatch):
    work, env = new_user
    monkeypatch.setenv("HOME", env["HOME"])
    monkeypatch.chdir(work)
    shutil.copy(work / "examples" / "demo.yaml", work / "my.yaml")
    assert len(opd_commands()) >= 15
    resolved = [
        (config, overrides)
        for config, overrides in config_commands()
        if not samples_with_vllm(config)
    ]
    assert len(resolved) >= 10
    for config, overrides in resolved:
        load_config(config, overrides)
