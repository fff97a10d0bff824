"""``student.sampler: vllm_server``'s settings, checked when the config is read (the trainer side
needs no vLLM: it speaks HTTP), and the disaggregated recipe resolving for its 4 training processes."""

from __future__ import annotations

from pathlib import Path

import pytest

from opd.config import ConfigError, config_from_dict, load_config
from opd.trainer.processes import check_processes

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
        ({"sampler": "vllm_server"}, r"student\.rollout_servers: sampler: vllm_server needs at least one"),
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
            {"sampler": "hf", "rollout_servers": ["http://a:1"]},
            r"student\.rollout_servers: applies to sampler: vllm_server only \(student\.sampler is 'hf'\)",
        ),
        (
            {"sampler": "vllm_server", "rollout_servers": ["http://a:1"], "lora_sync": "adapter"},
            r"student\.lora_sync: applies to sampler: vllm only \(student\.sampler is 'vllm_server'\)",
        ),
        (
            {"sampler": "vllm_server", "rollout_servers": ["http://a:1"], "sampler_options": {"seed": 1}},
            r"student\.sampler_options: applies to sampler: vllm only",
        ),
    ],
)
def test_server_settings_that_cannot_work_are_refused_naming_the_field(base_config, student, message):
    base_config["student"] |= student
    with pytest.raises(ConfigError, match=message):
        config_from_dict(base_config)
