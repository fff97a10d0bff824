"""``student.sampler: vllm_server``'s settings, checked when the config is read (the trainer side
needs no vLLM: it speaks HTTP), and the disaggregated recipe resolving for its 4 training
processes."""

from __future__ import annotations

from pathlib import Path

import pytest

from opd.assemble.processes import check_processes
from opd.cli import main
from opd.config import ConfigError, config_from_dict, load_config
from opd.sampling.rollout_server import rollout_server_command

RECIPE = Path(__file__).parents[1] / "examples" / "rollout_servers_8gpu.yaml"


def test_the_disaggregated_recipe_resolves_for_four_training_processes():
    config = load_config(RECIPE, [])
    assert config.student.sampler == "vllm_server"
    assert config.student.rollout_servers == ["http://127.0.0.1:8104", "http://127.0.0.1:8105"]
    assert config.training.max_staleness == 1 and config.teacher.backend == "openai"
    assert check_processes(config, 4) == "fsdp"


@pytest.mark.parametrize(
    ("student", "message"),
    [
        (
            {"sampler": "vllm_server"},
            r"student\.rollout_servers: sampler: vllm_server needs at least one",
        ),
        (
            {"sampler": "vllm_server", "rollout_servers": ["127.0.0.1:8000"]},
            r"student\.rollout_servers\[0\]: '127\.0\.0\.1:8000' is not an http\(s\) URL",
        ),
        (
            {"sampler": "vllm_server", "rollout_servers": ["http://a:1", "http://a:1"]},
            r"student\.rollout_servers: a server is listed twice",
        ),
        (
            {"sampler": "vllm_server", "rollout_servers": ["http://a:1"], "rollout_timeout_s": 0},
            r"student\.rollout_timeout_s: must be above 0, got 0",
        ),
        (
            {"sampler": "vllm_server", "rollout_servers": ["http://a:1"], "rollout_rest_s": -1},
            r"student\.rollout_rest_s: must be 0 or above, got -1",
        ),
        (
            {"sampler": "hf", "rollout_servers": ["http://a:1"]},
            r"student\.rollout_servers: applies to sampler: vllm_server only \(student\.sampler is "
            r"'hf'\)",
        ),
        (
            {"sampler": "vllm_server", "rollout_servers": ["http://a:1"], "lora_sync": "adapter"},
            r"student\.lora_sync: applies to sampler: vllm only \(student\.sampler is "
            r"'vllm_server'\)",
        ),
        (
            {
                "sampler": "vllm_server",
                "rollout_servers": ["http://a:1"],
                "sampler_options": {"seed": 1},
            },
            r"student\.sampler_options: applies to sampler: vllm only",
        ),
    ],
)
def test_server_settings_that_cannot_work_are_refused_naming_the_field(
    base_config, student, message
):
    base_config["student"] |= student
    with pytest.raises(ConfigError, match=message):
        config_from_dict(base_config)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--logprobs-mode", "raw_logprobs"],
            "--logprobs-mode is set by opd to processed_logprobs",
        ),
        (["--generation-config=auto"], "--generation-config is set by opd to vllm"),
        (["--model", "other"], "--model is set by opd from MODEL, --host and --port"),
    ],
)
def test_rollout_server_refuses_vllm_options_that_would_make_the_trainer_refuse_it(
    args, message, capsys
):
    assert main(["rollout-server", "student-dir", *args]) == 2
    assert capsys.readouterr().err.startswith(f"opd: error: opd rollout-server: {message}")


def test_rollout_server_without_vllm_says_what_to_install(monkeypatch, capsys):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name: None if name == "vllm" else find_spec(name)
    )
    assert main(["rollout-server", "student-dir", "--dtype", "bfloat16"]) == 2
    assert "pip install 'opd[vllm]'" in capsys.readouterr().err


def test_rollout_server_command_sets_what_the_trainer_checks_and_passes_the_rest_on():
    command = rollout_server_command("dir", "127.0.0.1", 8100, ["--dtype", "bfloat16"])
    assert command[:2] == ["-m", "vllm.entrypoints.openai.api_server"]
    options = dict(zip(command[2::2], command[3::2], strict=True))
    assert options == {
        "--model": "dir",
        "--host": "127.0.0.1",
        "--port": "8100",
        "--logprobs-mode": "processed_logprobs",
        "--generation-config": "vllm",
        "--weight-transfer-config": '{"backend": "opd_safetensors"}',
        "--middleware": "opd.sampling.rollout_guard.RolloutAuth",
        "--dtype": "bfloat16",
    }
