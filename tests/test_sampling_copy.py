"""Sampling from a bfloat16 copy of the student, and the fused AdamW the student trains with."""

import pytest
import torch

from opd.assemble.optimizer import adamw
from opd.config import config_from_dict
from opd.logprobs import sequence_logprobs
from opd.sampling.precision import SamplingCopy
from opd.trainer.loop import Trainer
from tests.conftest import tiny_llama, trained_and_loading


def assert_copy_holds(student, copied, dtype=torch.bfloat16):
    for (name, trained), (copied_name, held) in zip(
        student.named_parameters(), copied.named_parameters(), strict=True
    ):
        assert name == copied_name and held.dtype == dtype
        assert torch.equal(held, trained.detach().to(dtype)), name


def released(model) -> bool:
    return all(p.numel() == 0 for p in model.parameters())


def test_copy_is_cast_keeps_ties_and_buffers_and_shares_no_storage(char_tokenizer):
    student = tiny_llama(len(char_tokenizer), seed=3)
    sampling = SamplingCopy(student, torch.bfloat16)
    assert released(sampling.model)  # every weight is trainable: none is held between rollouts
    with sampling.rollout() as copied:
        assert_copy_holds(student, copied)
        assert copied.lm_head.weight is copied.model.embed_tokens.weight
        assert copied.model.rotary_emb.inv_freq.dtype == torch.float32
        assert all(p.dtype == torch.float32 for p in student.parameters())
        assert not any(p.requires_grad for p in copied.parameters())
        with torch.no_grad():
            student.model.norm.weight.add_(1.0)
        assert not torch.equal(
            copied.model.norm.weight, student.model.norm.weight.to(torch.bfloat16)
        )
    assert released(sampling.model)


def test_frozen_and_trainable_weights_are_cast_at_each_rollout(char_tokenizer):
    student = tiny_llama(len(char_tokenizer), seed=3)
    student.model.norm.weight.requires_grad_(False)
    sampling = SamplingCopy(student, torch.bfloat16)
    with torch.no_grad():
        for parameter in student.parameters():
            parameter.mul_(0.5).add_(0.25)
    with sampling.rollout() as copied:
        assert_copy_holds(student, copied)
    assert released(sampling.model)


def copy_and_student_logprobs(trainer, batch):
    with torch.no_grad(), trainer.parts.engine.copy.rollout() as copied:
        from_copy, _ = sequence_logprobs(
            copied, batch.input_ids_BT, batch.attention_mask_BT, batch.mask_BT
        )
        from_student, _ = sequence_logprobs(
            trainer.parts.student, batch.input_ids_BT, batch.attention_mask_BT, batch.mask_BT
        )
    return from_copy, from_student


def test_rollouts_come_from_the_copy_and_evaluation_from_the_student(base_config):
    base_config["student"]["sampling_dtype"] = "bfloat16"
    trainer = Trainer(config_from_dict(base_config), progress=False)
    assert trainer.parts.sampler.model is trainer.parts.student
    assert trainer.parts.engine.model is trainer.parts.engine.copy.model
    trainer.train_step(0)
    batch, _ = trainer.collector.sample_batch(1)
    assert released(trainer.parts.engine.copy.model)
    mask = batch.mask_BT.bool()
    # the weights it sampled with: the student has not moved since
    with trainer.parts.engine.copy.rollout() as copied:
        assert_copy_holds(trainer.parts.student, copied)
    from_copy, from_student = copy_and_student_logprobs(trainer, batch)
    # bfloat16 keeps 8 bits of mantissa: a logit near 10 rounds by up to 0.04, and a decode step
    # (KV cache) and a whole-sequence forward round differently
    torch.testing.assert_close(from_copy[mask], batch.sampled_logprobs_BT[mask], atol=5e-2, rtol=0)
    copy_error = (from_copy[mask] - batch.sampled_logprobs_BT[mask]).abs().max()
    student_error = (from_student[mask] - batch.sampled_logprobs_BT[mask]).abs().max()
    assert copy_error < student_error
    metrics = trainer.train_step(1)
    assert 0 < abs(metrics["kl_sample_train"]) < 0.05


def lora_trained_a_step(base_config, **student):
    base_config["student"] |= {"lora_rank": 4, "lora_alpha": 8} | student
    base_config["training"]["learning_rate"] = 0.05
    trainer = Trainer(config_from_dict(base_config), progress=False)
    trainer.train_step(0)
    return trainer


def test_copy_of_a_lora_student_has_its_adapters_merged_and_holds_nothing_between_rollouts(
    base_config,
):
    trainer = lora_trained_a_step(base_config, sampling_dtype="bfloat16")
    batch, _ = trainer.collector.sample_batch(1)
    assert released(trainer.parts.engine.copy.model)
    student = trainer.parts.student.get_base_model()
    q_proj = student.model.layers[0].self_attn.q_proj
    # W + (alpha / r) * B @ A, written out from the adapter's own matrices
    delta = (q_proj.lora_B["default"].weight @ q_proj.lora_A["default"].weight) * (8 / 4)
    assert delta.abs().max() > 1e-3  # the step moved the adapter off its zero start
    with trainer.parts.engine.copy.rollout() as copied:
        assert not any("lora_" in name for name, _ in copied.named_parameters())
        assert type(copied.model.layers[0].self_attn.q_proj) is torch.nn.Linear
        expected = (q_proj.base_layer.weight + delta).to(torch.bfloat16)
        assert torch.equal(copied.model.layers[0].self_attn.q_proj.weight, expected)
        assert torch.equal(copied.model.norm.weight, student.model.norm.weight.to(torch.bfloat16))
    from_copy, from_student = copy_and_student_logprobs(trainer, batch)
    mask = batch.mask_BT.bool()
    recorded = batch.sampled_logprobs_BT[mask]
    copy_error = (from_copy[mask] - recorded).abs().max()
    assert copy_error < 5e-2  # bfloat16 decoding vs a bfloat16 forward over the whole sequence
    assert copy_error < (from_student[mask] - recorded).abs().max() / 2


def test_a_lora_student_gets_a_merged_copy_in_its_own_dtype_that_scores_as_it_does(base_config):
    trainer = lora_trained_a_step(base_config, dtype="float32", sampling_dtype="float32")
    assert (
        trainer.parts.engine.copy is not None
        and trainer.parts.engine.model is trainer.parts.engine.copy.model
    )
    batch, _ = trainer.collector.sample_batch(1)
    embedding = trainer.parts.student.get_base_model().model.embed_tokens.weight
    with (
        trainer.parts.engine.copy.rollout() as copied
    ):  # what needs no merge or cast is shared, not copied
        assert copied.model.embed_tokens.weight.data_ptr() == embedding.data_ptr()
    assert embedding.numel() > 0
    from_copy, from_student = copy_and_student_logprobs(trainer, batch)
    mask = batch.mask_BT.bool()
    torch.testing.assert_close(from_copy[mask], from_student[mask], atol=1e-5, rtol=0)
    torch.testing.assert_close(
        batch.sampled_logprobs_BT[mask], from_student[mask], atol=1e-5, rtol=0
    )


@pytest.mark.filterwarnings("ignore:Model has `tie_word_embeddings=True`")
def test_a_lora_embedding_tied_to_the_head_stays_unmerged_in_the_copy(base_config):
    trainer = lora_trained_a_step(
        base_config,
        dtype="float32",
        sampling_dtype="float32",
        lora_target_modules=["embed_tokens", "q_proj"],
    )
    batch, _ = trainer.collector.sample_batch(1)
    with trainer.parts.engine.copy.rollout() as copied:
        lora_names = [name for name, _ in copied.named_parameters() if "lora_" in name]
        assert lora_names and all(name.startswith("model.embed_tokens.") for name in lora_names)
        assert type(copied.model.layers[0].self_attn.q_proj) is torch.nn.Linear
        assert copied.lm_head.weight is copied.model.embed_tokens.base_layer.weight
    from_copy, from_student = copy_and_student_logprobs(trainer, batch)
    mask = batch.mask_BT.bool()
    torch.testing.assert_close(from_copy[mask], from_student[mask], atol=1e-5, rtol=0)


def test_weights_loaded_at_start_reach_the_copy(base_config, tmp_path):
    first, second = trained_and_loading(base_config, tmp_path)
    second["student"] = dict(base_config["student"], sampling_dtype="bfloat16")
    trainer = Trainer(config_from_dict(second), progress=False)
    trainer.parts.config.training.max_steps = trainer.parts.num_steps = 0
    trainer.run()
    with trainer.parts.engine.copy.rollout() as copied:
        assert_copy_holds(first.student, copied)


def test_an_adapter_loaded_at_start_is_merged_into_the_copy(base_config, tmp_path):
    base_config["student"] |= {"lora_rank": 4, "lora_alpha": 8}
    first, second = trained_and_loading(base_config, tmp_path)
    second["student"] = dict(base_config["student"], sampling_dtype="float32")
    trainer = Trainer(config_from_dict(second), progress=False)
    trainer.parts.config.training.max_steps = trainer.parts.num_steps = 0
    trainer.run()
    trained = first.student.get_base_model().model.layers[1].mlp.down_proj
    delta = (trained.lora_B["default"].weight @ trained.lora_A["default"].weight) * (8 / 4)
    assert delta.abs().max() > 0
    with trainer.parts.engine.copy.rollout() as copied:
        merged = copied.model.layers[1].mlp.down_proj.weight
        torch.testing.assert_close(merged, trained.base_layer.weight + delta, atol=1e-6, rtol=0)


def test_sampling_dtype_equal_to_a_full_fine_tuned_students_makes_no_copy(base_config):
    base_config["student"] |= {"dtype": "float32", "sampling_dtype": "float32"}
    trainer = Trainer(config_from_dict(base_config), progress=False)
    assert (
        trainer.parts.engine.copy is None
        and trainer.parts.engine.model is trainer.parts.sampler.model
    )


def test_adamw_is_fused_on_cpu_and_takes_a_decoupled_decay_step():
    weight = torch.nn.Parameter(torch.tensor([1.0, -2.0]))
    optimizer = adamw([weight], lr=0.1, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01)
    assert optimizer.defaults["fused"] is True
    weight.grad = torch.tensor([0.5, -4.0])
    optimizer.step()
    # first step: bias-corrected m / sqrt(v) = sign(grad); decay multiplies by 1 - lr * wd
    expected = torch.tensor([1.0 * (1 - 0.001) - 0.1, -2.0 * (1 - 0.001) + 0.1])
    torch.testing.assert_close(weight.detach(), expected)
