"""Sampling from a bfloat16 copy of the student, and the fused AdamW the student trains with."""

import torch

from opd.config import config_from_dict
from opd.logprobs import sequence_logprobs
from opd.sampling.precision import SamplingCopy
from opd.trainer.loop import Trainer
from opd.trainer.optimizer import adamw
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
        assert not torch.equal(copied.model.norm.weight, student.model.norm.weight.to(torch.bfloat16))
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


def test_rollouts_come_from_the_copy_and_evaluation_from_the_student(base_config):
    base_config["student"]["sampling_dtype"] = "bfloat16"
    trainer = Trainer(config_from_dict(base_config), progress=False)
    assert trainer.sampler.model is trainer.student
    assert trainer.rollout_sampler.model is trainer.sampling_copy.model
    trainer.train_step(0)
    batch, _ = trainer.sample_batch(1)
    assert released(trainer.sampling_copy.model)
    mask = batch.mask_BT.bool()
    # the weights it sampled with: the student has not moved since
    with torch.no_grad(), trainer.sampling_copy.rollout() as copied:
        assert_copy_holds(trainer.student, copied)
        from_copy, _ = sequence_logprobs(copied, batch.input_ids_BT, batch.attention_mask_BT, batch.mask_BT)
        from_student, _ = sequence_logprobs(
            trainer.student, batch.input_ids_BT, batch.attention_mask_BT, batch.mask_BT
        )
    torch.testing.assert_close(from_copy[mask], batch.sampled_logprobs_BT[mask], atol=2e-2, rtol=0)
    copy_error = (from_copy[mask] - batch.sampled_logprobs_BT[mask]).abs().max()
    student_error = (from_student[mask] - batch.sampled_logprobs_BT[mask]).abs().max()
    assert copy_error < student_error
    metrics = trainer.train_step(1)
    assert 0 < abs(metrics["kl_sample_train"]) < 0.05


def test_copy_of_a_lora_student_follows_its_adapters_and_holds_nothing_between_rollouts(base_config):
    base_config["student"] |= {"lora_rank": 4, "sampling_dtype": "bfloat16"}
    trainer = Trainer(config_from_dict(base_config), progress=False)
    trainer.train_step(0)
    trainer.sample_batch(1)
    assert released(trainer.sampling_copy.model)
    with trainer.sampling_copy.rollout() as copied:
        assert_copy_holds(trainer.student, copied)
        assert any("lora_" in name for name, _ in copied.named_parameters())


def test_weights_loaded_at_start_reach_the_copy(base_config, tmp_path):
    first, second = trained_and_loading(base_config, tmp_path)
    second["student"] = dict(base_config["student"], sampling_dtype="bfloat16")
    trainer = Trainer(config_from_dict(second), progress=False)
    trainer.config.training.max_steps = trainer.num_steps = 0
    trainer.run()
    with trainer.sampling_copy.rollout() as copied:
        assert_copy_holds(first.student, copied)


def test_sampling_dtype_equal_to_the_students_makes_no_copy(base_config):
    base_config["student"] |= {"dtype": "float32", "sampling_dtype": "float32"}
    trainer = Trainer(config_from_dict(base_config), progress=False)
    assert trainer.sampling_copy is None and trainer.rollout_sampler is trainer.sampler


def test_adamw_is_fused_on_cpu_and_takes_a_decoupled_decay_step():
    weight = torch.nn.Parameter(torch.tensor([1.0, -2.0]))
    optimizer = adamw([weight], lr=0.1, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01)
    assert optimizer.defaults["fused"] is True
    weight.grad = torch.tensor([0.5, -4.0])
    optimizer.step()
    # first step: bias-corrected m / sqrt(v) = sign(grad); decay multiplies by 1 - lr * wd
    expected = torch.tensor([1.0 * (1 - 0.001) - 0.1, -2.0 * (1 - 0.001) + 0.1])
    torch.testing.assert_close(weight.detach(), expected)
