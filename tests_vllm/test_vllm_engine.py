"""The vLLM rollout engine against a real in-process vLLM: its log-probs are the trainer's, before
and after every update, for full fine-tuning and both LoRA sync modes; seeds, stops and errors."""

from __future__ import annotations

import copy
import logging

import pytest
import torch

from opd.config import ConfigError, config_from_dict
from opd.sampling.base import SamplingParams, row_seeds
from opd.sampling.vllm_engine import VLLMEngine
from opd.sampling.vllm_reload import RELOAD_LOGGER
from opd.trainer.loop import Trainer, train
from tests.conftest import quick_to_stop, tiny_llama

STUDENTS = {
    "full-untied": {"model": "untied", "lora_rank": 0},
    "full-tied": {"model": "tied", "lora_rank": 0},
    "lora-merged": {"model": "tied", "lora_rank": 8, "lora_sync": "merged"},
    "lora-adapter": {"model": "untied", "lora_rank": 8, "lora_sync": "adapter"},
}


def configured(vllm_config, vllm_models, student: dict, **training) -> dict:
    config = copy.deepcopy(vllm_config)
    config["student"] |= student | {"model": str(vllm_models[student["model"]])}
    config["training"] |= training
    return config


def trainer_logprobs(trainer: Trainer, batch) -> torch.Tensor:
    """The trainer's own log-probs of the batch's sampled tokens, at the run's temperature."""
    rollouts = batch.rollouts
    with torch.no_grad():
        logprobs, _ = trainer.parts.policy.sequence_logprobs(
            rollouts.input_ids_BT,
            rollouts.attention_mask_BT,
            rollouts.mask_BT,
            temperature=trainer.parts.config.training.temperature,
        )
    return logprobs


def gap(trainer: Trainer, batch) -> float:
    """Largest |vLLM's recorded log-prob - the trainer's| over the batch's sampled tokens."""
    mask = batch.rollouts.mask_BT.bool()
    return float(
        (batch.rollouts.sampled_logprobs_BT - trainer_logprobs(trainer, batch))[mask].abs().max()
    )


class Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.mark.parametrize("student", list(STUDENTS))
def test_engine_samples_from_the_weights_being_trained(vllm_config, vllm_models, student):
    config = configured(
        vllm_config,
        vllm_models,
        STUDENTS[student],
        temperature=0.7,
        learning_rate=2e-2 if "lora" in student else 5e-3,
    )
    trainer = Trainer(config_from_dict(config), progress=False)
    # what vLLM's weight reloads log past opd's filter, as a console shows it (attached once vLLM
    # has configured its loggers, which drops handlers added before)
    shown = Records()
    logging.getLogger(RELOAD_LOGGER).addHandler(shown)
    assert (
        isinstance(trainer.parts.engine, VLLMEngine)
        and trainer.parts.sampler is trainer.parts.engine
    )
    first = trainer.collect(0)
    assert first.rollouts.mask_BT.sum() > 0
    assert gap(trainer, first) < 1e-4
    assert (first.rollouts.policy_version_B == 0).all()

    before = trainer_logprobs(trainer, first)
    trainer.learn(first)
    assert trainer.parts.policy.version == 1
    mask = first.rollouts.mask_BT.bool()
    moved = float((trainer_logprobs(trainer, first) - before)[mask].abs().max())
    assert moved > 1e-2, "the update must move the log-probs enough that a stale engine would show"

    second = trainer.collect(1)
    assert (second.rollouts.policy_version_B == 1).all()
    assert gap(trainer, second) < 1e-4
    logging.getLogger(RELOAD_LOGGER).removeHandler(shown)
    assert [m for m in shown.messages if "Failed to load weights" in m] == []


def test_rollouts_follow_their_seed_stop_at_the_stop_id_and_record_truncation(
    vllm_config, vllm_models
):
    trainer = Trainer(config_from_dict(vllm_config), progress=False)
    engine = trainer.parts.engine
    engine.sync(trainer.parts.policy)
    prompts = [trainer.parts.renderer.prompt_ids([{"role": "user", "content": "reverse abc"}])] * 6
    params = SamplingParams(temperature=1.0, max_tokens=12)
    once = engine.rollout(prompts, params, seeds=row_seeds(7, len(prompts)))
    again = engine.rollout(prompts, params, seeds=row_seeds(7, len(prompts)))
    other = engine.rollout(prompts, params, seeds=row_seeds(8, len(prompts)))
    assert [c.token_ids for c in once] == [c.token_ids for c in again]
    assert [c.logprobs for c in once] == [c.logprobs for c in again]
    assert [c.token_ids for c in once] != [c.token_ids for c in other]
    assert len({tuple(c.token_ids) for c in once}) > 1, (
        "rows of one prompt draw from seeds of their own"
    )
    stops = set(trainer.parts.renderer.stop_token_ids)
    for completion in once + other:
        ends_at_stop = completion.token_ids[-1] in stops
        assert completion.finished == ends_at_stop
        assert not any(t in stops for t in completion.token_ids[:-1])
        assert completion.finished or len(completion.token_ids) == 12
        assert len(completion.logprobs) == len(completion.token_ids)
    greedy = engine.sample(prompts[:2], temperature=1.0, max_tokens=12, greedy=True)
    assert greedy[0].token_ids == greedy[1].token_ids


@pytest.mark.parametrize("student", ["full-untied", "lora-merged"])
def test_ten_steps_keep_kl_sample_train_below_1e_3(vllm_config, vllm_models, student):
    config = configured(
        vllm_config,
        vllm_models,
        STUDENTS[student],
        max_steps=10,
        learning_rate=1e-3 if student.startswith("full") else 1e-2,
    )
    metrics = train(config_from_dict(config), progress=False).metrics
    assert [m["step"] for m in metrics] == list(range(10))
    kl = [abs(m["kl_sample_train"]) for m in metrics]
    assert max(kl) < 1e-3, kl
    assert all(m["time/weight_sync"] > 0 for m in metrics[1:])


class InLockStep:
    """The run's vLLM engine with its turn stream hidden: episodes played a turn of every row at a
    time."""

    turn_stream = None

    def __init__(self, engine):
        self.engine = engine

    def __getattr__(self, name):
        return getattr(self.engine, name)


def test_multi_turn_episodes_keep_kl_sample_train_below_1e_3(
    vllm_config, vllm_models, tmp_path, char_tokenizer
):
    """vLLM samples each turn of ``retry`` episodes (a student that ends its turns early, so that
    episodes go on after a wrong answer); the environment's replies are never trained on. Turns
    streamed into the running batch are the turns played in lock step, token for token."""
    quick = tmp_path / "quick"
    quick_to_stop(tiny_llama(len(char_tokenizer), hidden=128, seed=3, tie=False)).save_pretrained(
        quick
    )
    char_tokenizer.save_pretrained(quick)
    config = copy.deepcopy(vllm_config)
    config["student"]["model"] = str(quick)
    config["datasets"][0] |= {
        "num_prompts": 6,
        "env": {"name": "retry", "max_turns": 3, "max_episode_tokens": 120},
    }
    config["training"] |= {"max_steps": 3, "learning_rate": 5e-3}
    trainer = Trainer(config_from_dict(config), progress=False)
    first = trainer.collect(0)  # each episode's next turn joins vLLM's running batch when ready
    assert max(len(t.turns) for t in first.rollouts.trajectories) > 1
    assert gap(trainer, first) < 1e-4
    streamed = trainer.parts.engine
    trainer.parts.engine = InLockStep(streamed)
    again = trainer.collect(0)  # every row waiting for the batch's longest turn, as before
    assert again.rollouts.trajectories == first.rollouts.trajectories
    assert torch.equal(again.rollouts.input_ids_BT, first.rollouts.input_ids_BT)
    trainer.parts.engine = streamed
    metrics = train(config_from_dict(config), progress=False).metrics
    assert max(abs(m["kl_sample_train"]) for m in metrics) < 1e-3, metrics
    assert max(m["episode/turns"] for m in metrics) > 1


def test_evaluation_decodes_with_the_synced_engine(vllm_config, vllm_models, tmp_path):
    config = copy.deepcopy(vllm_config)
    config["datasets"] = [
        {
            "name": "rev",
            "source": "demo:reverse",
            "groups_per_batch": 2,
            "group_size": 2,
            "eval_num_prompts": 8,
        }
    ]
    config |= {"eval_every": 2}
    config["training"] |= {"max_steps": 2}
    metrics = train(config_from_dict(config), progress=False).metrics
    evaluated = [m for m in metrics if "test/rev/accuracy" in m]
    assert [m["step"] for m in evaluated] == [0, 2]


def test_sampler_options_vllm_does_not_take_are_refused_by_name(vllm_config):
    vllm_config["student"]["sampler_options"] = {"max_model_length": 256}
    with pytest.raises(
        ConfigError,
        match=r"student\.sampler_options\.max_model_length: .*did you mean "
        r"'max_model_len'",
    ):
        config_from_dict(vllm_config)
    vllm_config["student"]["sampler_options"] = {"dtype": "float16"}
    with pytest.raises(
        ConfigError,
        match=r"student\.sampler_options\.dtype: set by opd from "
        r"student\.dtype",
    ):
        config_from_dict(vllm_config)


def test_lora_rank_above_the_engines_max_lora_rank_is_refused(vllm_config):
    vllm_config["student"] |= {"lora_rank": 16, "lora_sync": "adapter"}
    vllm_config["student"]["sampler_options"] |= {"max_lora_rank": 8}
    with pytest.raises(
        ConfigError,
        match=r"student\.sampler_options\.max_lora_rank: 8 is below "
        r"student\.lora_rank 16",
    ):
        config_from_dict(vllm_config)


def test_a_value_vllm_rejects_is_a_config_error_before_training(vllm_config, tmp_path):
    vllm_config["student"]["sampler_options"] |= {"max_model_len": 100_000}
    with pytest.raises(
        ConfigError, match=r"student\.sampler: vLLM could not build an engine .*max_model_len"
    ):
        Trainer(config_from_dict(vllm_config), progress=False)
    assert not (tmp_path / "run").exists()


def test_an_architecture_vllm_does_not_support_is_a_config_error(
    vllm_config, vllm_models, tmp_path
):
    import json
    import shutil

    odd = tmp_path / "odd"
    shutil.copytree(vllm_models["untied"], odd)
    config_json = json.loads((odd / "config.json").read_text())
    config_json["architectures"] = ["OpdNoSuchModelForCausalLM"]
    (odd / "config.json").write_text(json.dumps(config_json))
    vllm_config["student"]["model"] = str(odd)
    with pytest.raises(
        ConfigError,
        match=r"student\.sampler: vLLM could not build an engine for "
        r".*odd",
    ):
        Trainer(config_from_dict(vllm_config), progress=False)


def test_an_embedding_wider_than_the_tokenizer_is_never_sampled_past_it(
    vllm_config, char_tokenizer, tmp_path
):
    """Checkpoints often pad the vocabulary (Qwen: 151,936 rows for 151,665 ids): vLLM must sample,
    and normalise its log-probs, over the tokenizer's ids only, as the trainer does."""
    from tests.conftest import tiny_llama

    padded = tmp_path / "padded"
    model = tiny_llama(128, hidden=128, seed=5, tie=False)
    with torch.no_grad():
        model.lm_head.weight[len(char_tokenizer) :] *= 0  # logit 0: well inside the distribution
    model.save_pretrained(padded)
    char_tokenizer.save_pretrained(padded)
    vllm_config["student"]["model"] = str(padded)
    vllm_config["training"] |= {"max_tokens": 16}
    trainer = Trainer(config_from_dict(vllm_config), progress=False)
    assert trainer.parts.engine.allowed_token_ids == list(range(len(char_tokenizer)))
    batch = trainer.collect(0)
    sampled = batch.rollouts.input_ids_BT[batch.rollouts.mask_BT.bool()]
    assert sampled.max() < len(char_tokenizer)
    assert gap(trainer, batch) < 1e-4


def test_sleep_mode_on_a_cpu_is_refused_with_vllms_reason(vllm_config):
    vllm_config["student"]["sampler_options"] |= {"enable_sleep_mode": True}
    with pytest.raises(
        ConfigError,
        match=r"student\.sampler: vLLM could not build an engine .*ValidationError: 1 validation "
        r"error for "
        r"ModelConfig Value error, Sleep mode is not supported on current platform\.$",
    ):
        Trainer(config_from_dict(vllm_config), progress=False)


def test_collection_ahead_with_an_adapter_sync_is_refused(vllm_config):
    vllm_config["student"] |= {"lora_rank": 8, "lora_sync": "adapter"}
    vllm_config["training"] |= {"max_staleness": 1}
    with pytest.raises(
        ConfigError,
        match=r"training\.max_staleness: .*student\.lora_sync: adapter reads the "
        r"adapter being",
    ):
        config_from_dict(vllm_config)


def test_the_eight_gpu_recipe_resolves_for_8_processes_and_its_tensor_parallel_variant_for_pairs(
    vllm_models,
):
    """Every key of the recipe is valid and its engine layout fits 8 processes (vLLM checks it
    from the model's config file: a local tiny model stands in for the hub's Qwen3 here, with the
    settings vLLM's CPU platform or the tiny model cannot take overridden: sleep mode, 5120
    tokens)."""
    from pathlib import Path

    from opd.assemble.processes import check_processes
    from opd.config import load_config

    recipe = str(Path(__file__).parents[1] / "examples" / "vllm_fsdp_8gpu.yaml")
    local = [
        f"student.model={vllm_models['untied']}",
        f"teacher.model={vllm_models['teacher']}",
        "student.sampler_options.enable_sleep_mode=false",
        "student.sampler_options.max_model_len=256",
    ]
    config = load_config(recipe, local)
    assert config.student.sampler == "vllm" and config.training.max_tokens == 4096
    assert check_processes(config, 8) == "fsdp"
    paired = load_config(recipe, [*local, "student.sampler_options.tensor_parallel_size=2"])
    assert check_processes(paired, 8) == "fsdp"
    with pytest.raises(ConfigError, match="3 does not divide the 8 training processes"):
        check_processes(
            load_config(recipe, [*local, "student.sampler_options.tensor_parallel_size=3"]), 8
        )
