"""The ``student`` section as the rollout engines declare it: each engine's settings beside it,
registered by name, all of them in one flat mapping, and only the chosen engine's applying."""

import dataclasses

import pytest

from opd.config import ConfigError, StudentConfig, config_from_dict
from opd.sampling.base import SamplerSettings
from opd.sampling.engines import ENGINES, StudentSection


def test_the_student_section_holds_every_registered_engines_settings_and_nothing_else():
    fields = {f.name for f in dataclasses.fields(StudentSection)}
    declared = set().union(
        *({f.name for f in dataclasses.fields(e.settings)} for e in ENGINES.values())
    )
    assert all(issubclass(StudentSection, engine.settings) for engine in ENGINES.values())
    assert fields == declared
    model = {f.name for f in dataclasses.fields(StudentConfig)}
    assert {f.name for f in dataclasses.fields(SamplerSettings)} == model | {
        "sampler",
        "sampling_dtype",
    }


def test_a_setting_two_engines_share_is_refused_with_the_third_naming_both(base_config):
    base_config["student"]["sync_bucket_mb"] = 64
    with pytest.raises(
        ConfigError,
        match=r"student\.sync_bucket_mb: applies to sampler: vllm or vllm_server only "
        r"\(student\.sampler is 'hf'\)",
    ):
        config_from_dict(base_config)


def test_a_setting_equal_to_its_default_is_no_choice_of_engine(base_config):
    base_config["student"] |= {
        "sync_bucket_mb": 512,
        "rollout_timeout_s": 300,
        "lora_sync": "merged",
    }
    assert config_from_dict(base_config).student.sampler == "hf"


def test_each_engine_writes_its_own_line_of_the_dry_run_plan():
    def line(**settings):
        return StudentSection(model="m", **settings).plan_line()

    assert line() == "hf generate, in every process"
    assert line(sampler="vllm", sampler_options={"tensor_parallel_size": 2}) == (
        "vllm in every process (tensor_parallel_size 2), gpu_memory_utilization 0.3 on a GPU"
    )
    servers = ["http://a:1", "http://b:2"]
    assert (
        line(sampler="vllm_server", rollout_servers=servers)
        == "vllm servers http://a:1, http://b:2"
    )


def test_the_chosen_engines_checks_run_not_those_the_section_inherits_first():
    """The section inherits every engine's ``sampler_problems``; the server's come first in its
    MRO, so a vLLM engine's checks running must be the registry's choice, not inheritance."""
    server = StudentSection(model="m", sampler="vllm_server", rollout_servers=[], sync_bucket_mb=0)
    assert list(server.sampler_problems()) == [
        ("sync_bucket_mb", "must be above 0, got 0"),
        (
            "rollout_servers",
            "sampler: vllm_server needs at least one server URL (http://host:port)",
        ),
    ]
    bad_size = {"tensor_parallel_size": 0}
    in_process = StudentSection(
        model="m", sampler="vllm", sampler_options=bad_size, rollout_timeout_s=0
    )
    assert list(in_process.sampler_problems()) == [
        ("sampler_options.tensor_parallel_size", "must be a whole number >= 1, got 0")
    ]
    assert (
        list(StudentSection(model="m", rollout_servers=[], sync_bucket_mb=0).sampler_problems())
        == []
    )
