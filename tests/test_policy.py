"""The policy seam: every use of the student's weights goes through one module call or one
method."""

import os

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM

from opd.config import config_from_dict
from opd.policy import Policy, StudentConfig
from opd.policy.lora import apply_lora
from opd.trainer.loop import Trainer
from tests.conftest import tiny_llama


class CountingWrapper(nn.Module):
    """What DDP or FSDP would put around the policy's module: here it only counts the calls."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner, self.calls = inner, 0

    def forward(self, *args, **kwargs):
        self.calls += 1
        return self.inner(*args, **kwargs)


def guard_head(trainer: Trainer) -> list[str]:
    """Make the student's lm head refuse to hand out its weight outside the policy's module call.

    Returns the list that collects every refused access (empty when the seam holds).
    """
    refused: list[str] = []
    inside = {"now": False}
    module = trainer.parts.policy.module
    module.register_forward_pre_hook(lambda *_: inside.update(now=True))
    module.register_forward_hook(lambda *_: inside.update(now=False))
    head = trainer.parts.student.get_output_embeddings()
    original = type(head)

    class GuardedHead(original):
        def __getattr__(self, name):
            if name == "weight" and not inside["now"]:
                refused.append(name)
            return super().__getattr__(name)

    head.__class__ = GuardedHead
    return refused


@pytest.mark.parametrize(
    "objective",
    ["sampled_reverse_kl", {"name": "jsd", "beta": 0.5}, {"name": "topk_forward_kl", "topk": 4}],
)
def test_the_update_reads_the_lm_head_only_inside_the_policys_module_call(base_config, objective):
    base_config["training"].update(objective=objective, micro_batch_size=1, num_substeps=2)
    trainer = Trainer(config_from_dict(base_config), progress=False)
    batch = trainer.collect(0)  # sampling reads the head through generate, outside the update
    refused = guard_head(trainer)
    trainer.parts.policy.module = CountingWrapper(trainer.parts.policy.module)
    metrics = trainer.learn(batch)
    assert metrics["skipped"] == 0 and metrics["grad_norm"] > 0
    assert refused == []
    assert trainer.parts.policy.module.calls == len(
        batch.rollouts.prompt_lengths
    )  # one call per micro-batch


def test_an_update_through_a_real_ddp_wrapper_equals_the_plain_one(base_config, tmp_path):
    """The one-module forward is what DDP needs: wrapped (gloo, one process), the step is the
    same."""
    changes = []
    for wrapped in (False, True):
        trainer = Trainer(config_from_dict(base_config), progress=False)
        before = {k: v.detach().clone() for k, v in trainer.parts.student.named_parameters()}
        batch = trainer.collect(0)
        if wrapped:
            store = torch.distributed.FileStore(str(tmp_path / "store"), 1)
            torch.distributed.init_process_group("gloo", store=store, rank=0, world_size=1)
            trainer.parts.policy.module = nn.parallel.DistributedDataParallel(
                trainer.parts.policy.module
            )
        try:
            trainer.learn(batch)
        finally:
            if wrapped:
                torch.distributed.destroy_process_group()
        changes.append(
            {k: v.detach() - before[k] for k, v in trainer.parts.student.named_parameters()}
        )
    assert any(change.abs().max() > 1e-5 for change in changes[0].values())
    for name, change in changes[0].items():
        torch.testing.assert_close(changes[1][name], change, atol=1e-6, rtol=1e-5, msg=name)


def test_every_optimizer_step_advances_the_version_and_resume_restores_it(base_config):
    base_config["training"].update(num_substeps=2, max_steps=2)
    base_config["save_every"] = 1
    trainer = Trainer(config_from_dict(base_config), progress=False)
    assert trainer.parts.policy.version == 0
    trainer.run()
    assert trainer.parts.policy.version == 4  # 2 steps x 2 substeps
    base_config["training"]["max_steps"] = 3
    resumed = Trainer(config_from_dict(base_config), progress=False)
    batches = []
    original = resumed.collect
    resumed.collect = lambda step: batches.append(original(step)) or batches[-1]
    resumed.run()
    assert [b.rollouts.policy_version_B.unique().tolist() for b in batches] == [[4]]
    assert resumed.parts.policy.version == 6


def lora_policy(char_tokenizer, rank: int = 4) -> Policy:
    torch.manual_seed(0)
    model = apply_lora(
        tiny_llama(len(char_tokenizer), seed=5), StudentConfig("tiny", lora_rank=rank, lora_alpha=8)
    )
    for name, parameter in model.named_parameters():
        if "lora_B" in name:
            nn.init.normal_(parameter, std=0.1)  # a trained adapter, not PEFT's zero start
    return Policy(model, len(char_tokenizer))


def test_sampler_weights_are_plain_names_with_lora_merged_and_ties_once(char_tokenizer):
    policy = lora_policy(char_tokenizer)
    weights = dict(policy.sampler_weights(torch.bfloat16))
    plain = tiny_llama(len(char_tokenizer), seed=5)
    assert set(weights) == {
        name for name, _ in plain.named_parameters()
    }  # lm_head tied: not listed again
    assert all(w.dtype == torch.bfloat16 for w in weights.values())
    q_proj = policy.base_model.model.layers[0].self_attn.q_proj
    merged = (
        q_proj.base_layer.weight
        + (q_proj.lora_B["default"].weight @ q_proj.lora_A["default"].weight) * 2
    )
    assert torch.equal(
        weights["model.layers.0.self_attn.q_proj.weight"], merged.detach().to(torch.bfloat16)
    )


def test_sampler_weights_give_a_plain_model_the_students_outputs(char_tokenizer):
    policy = lora_policy(char_tokenizer)
    plain = tiny_llama(len(char_tokenizer), seed=9)  # other weights, same shapes
    missing, unexpected = plain.load_state_dict(
        dict(policy.sampler_weights(torch.float32)), strict=False
    )
    assert unexpected == [] and missing == ["lm_head.weight"]  # tied to the embedding
    plain.tie_weights()
    ids = torch.tensor([[1, 5, 6, 7, 8]])
    with torch.no_grad():
        torch.testing.assert_close(
            plain(ids).logits, policy.model(ids).logits, atol=1e-5, rtol=1e-5
        )


def test_save_and_load_weights_round_trip(char_tokenizer, tmp_path):
    policy = lora_policy(char_tokenizer)
    policy.save(tmp_path / "adapter")
    fresh = lora_policy(char_tokenizer)
    with torch.no_grad():
        for name, parameter in fresh.model.named_parameters():
            if "lora_" in name:
                parameter.zero_()
    fresh.load_weights(tmp_path / "adapter")
    ids = torch.tensor([[1, 5, 6, 7, 8]])
    with torch.no_grad():
        torch.testing.assert_close(fresh.model(ids).logits, policy.model(ids).logits)
    assert os.path.exists(tmp_path / "adapter" / "adapter_model.safetensors")


def test_a_full_model_loaded_from_a_directory_knows_its_device_dtype_and_stops(
    model_dirs, char_tokenizer
):
    policy = Policy.load(
        StudentConfig(str(model_dirs["student"]), lora_rank=0, dtype="float32"), len(char_tokenizer)
    )
    assert (
        policy.device == torch.device("cpu")
        and policy.dtype == torch.float32
        and not policy.has_adapters
    )
    assert policy.generation_stop_ids() == [2]
    assert isinstance(
        policy.model, type(AutoModelForCausalLM.from_pretrained(model_dirs["student"]))
    )
    assert {id(p) for p in policy.trainable_parameters()} == {
        id(p) for p in policy.model.parameters()
    }
