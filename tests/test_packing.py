"""Packed micro-batches: the bins by hand, and packed forwards against padded ones on the same rows.

Packing must change no number beyond float rounding: per-token log-probs within 1e-5, the loss
and every gradient of every objective within 1e-5 of their scale, full fine-tuning and LoRA,
the teacher's answers too. The processes' side is in tests/test_distributed.py.
"""

from __future__ import annotations

import dataclasses
import json
import random

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from opd.assemble.micro_batching import MicroBatching
from opd.cli import main
from opd.config import TrainingConfig
from opd.data.batching import split_to, token_bins
from opd.data.sequences import Completion, build_rollout_batch
from opd.logprobs import backbone_and_head, scored_hidden_states
from opd.objectives.registry import objectives
from opd.packing import packing_problem, use_packed_attention
from opd.policy.config import StudentConfig
from opd.policy.lora import apply_lora
from opd.policy.policy import Policy
from opd.teachers.base import TeacherInput, TeacherRequest
from opd.teachers.local import LocalTeacher
from opd.trainer.update import policy_gradient, policy_update

VOCAB = 40


def test_bins_by_hand():
    lengths = [5, 9, 2, 7, 3, 9]
    # packed, budget 12: longest first (rows 1, 5, 3, 0, 4, 2), each in the first bin it fits:
    # 9 | 9 | 7 | 7+5 | 9+3 | 9+2
    assert token_bins(lengths, 12, None, padded=False) == [[1, 4], [2, 5], [0, 3]]
    # padded, a bin costs rows x its longest row: 9 | 9 | 7 | 5 | 2 x 5 = 10 | 3 x 5 = 15 > 12
    assert token_bins(lengths, 12, None, padded=True) == [[1], [5], [3], [0, 4], [2]]
    # padded, budget 20: 2 x 9 = 18 | 2 x 7 = 14 | 3 x 7 = 21 > 20, so 3 and 2 together
    assert token_bins(lengths, 20, None, padded=True) == [[1, 5], [0, 3], [2, 4]]
    assert token_bins(lengths, 100, 2, padded=False) == [[1, 5], [0, 3], [2, 4]]  # rows capped too
    assert token_bins(lengths, 4, None, padded=False) == [
        [1],
        [5],
        [3],
        [0],
        [4],
        [2],
    ]  # too long: alone
    assert token_bins(lengths, None, 4, padded=False) == [
        [0, 1, 2],
        [3, 4, 5],
    ]  # rows: contiguous runs
    assert token_bins(lengths, None, None, padded=True) == [list(range(6))]
    rng = random.Random(0)
    many = [rng.randrange(1, 120) for _ in range(200)]
    for padded in (False, True):
        bins = token_bins(many, 300, None, padded=padded)
        assert sorted(row for members in bins for row in members) == list(range(200))
        cost = [
            max(many[r] for r in b) * len(b) if padded else sum(many[r] for r in b) for b in bins
        ]
        assert max(cost) <= 300
    # first-fit decreasing packs within 11/9 of the tokens' lower bound, plus one bin
    assert len(token_bins(many, 300, None, padded=False)) <= 11 / 9 * sum(many) / 300 + 1


def test_a_process_with_fewer_bins_splits_its_largest():
    assert split_to([[0, 1, 2, 3], [4]], 3) == [[0, 1], [2, 3], [4]]
    assert split_to([[0], [1, 2, 3]], 3) == [[0], [1], [2, 3]]
    with pytest.raises(ValueError, match="one row each"):
        split_to([[0], [1]], 3)


def model(seed: int, **config) -> LlamaForCausalLM:
    """A tiny Llama with grouped-query attention (4 heads, 2 key-value heads), float32, sdpa."""
    torch.manual_seed(seed)
    settings = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        pad_token_id=0,
        initializer_range=0.3,
        max_position_embeddings=64,
    )
    return LlamaForCausalLM(LlamaConfig(**(settings | config))).eval()


def rollouts(seed: int = 0):
    """Rows from 2 to 30 tokens: prompts of 1 to 8 tokens (one of a single token), completions of 1
    to 22."""
    rng = random.Random(seed)
    prompts, completions = [], []
    for prompt_length, completion_length in [
        (1, 1),
        (3, 22),
        (8, 2),
        (5, 9),
        (2, 1),
        (7, 16),
        (4, 4),
        (6, 12),
    ]:
        prompts.append([rng.randrange(1, VOCAB) for _ in range(prompt_length)])
        ids = [rng.randrange(1, VOCAB) for _ in range(completion_length)]
        completions.append(Completion(ids, [-rng.uniform(0.1, 4.0) for _ in ids], finished=True))
    return build_rollout_batch(prompts, completions, [0] * len(prompts), pad_id=0)


def gpt2() -> GPT2LMHeadModel:
    """A tiny GPT-2: learned absolute positions, so packed position ids must restart per
    sequence."""
    torch.manual_seed(3)
    config = GPT2Config(
        vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64, eos_token_id=2
    )
    return GPT2LMHeadModel(config).eval()


@torch.no_grad()
@pytest.mark.parametrize("build", [lambda: model(1), gpt2], ids=["llama-gqa", "gpt2"])
def test_packed_hidden_states_equal_padded_ones_for_every_scored_position(build):
    student, batch = build(), rollouts()
    assert packing_problem(student) is None
    padded = scored_hidden_states(
        student, batch.input_ids_BT, batch.attention_mask_BT, batch.mask_BT
    )
    packed = scored_hidden_states(
        student, batch.input_ids_BT, batch.attention_mask_BT, batch.mask_BT, packed=True
    )
    assert torch.equal(padded[1], packed[1]) and torch.equal(padded[2], packed[2])
    assert padded[0].shape == packed[0].shape == (int(batch.mask_BT[:, 1:].sum()), 32)
    assert float((padded[0] - packed[0]).abs().max()) < 1e-5 * float(padded[0].abs().max())
    # and each sequence alone, unpadded, is what its packed rows say: no attention across sequences
    lengths = batch.attention_mask_BT.sum(-1).tolist()
    start = 0
    for row, length in enumerate(lengths):
        body = backbone_and_head(student)[0]
        alone = body(input_ids=batch.input_ids_BT[row : row + 1, :length]).last_hidden_state[0]
        scored = batch.mask_BT[row, 1:length].bool()
        count = int(scored.sum())
        assert torch.allclose(alone[:-1][scored], packed[0][start : start + count], atol=1e-5)
        start += count


class RecordingOptimizer(torch.optim.Optimizer):
    """Keeps a copy of every gradient at each step and leaves the weights alone."""

    def __init__(self, parameters):
        super().__init__(parameters, {"lr": 0.0})
        self.gradients: list[list[torch.Tensor]] = []

    def step(self, closure=None):
        self.gradients.append(
            [p.grad.clone() for group in self.param_groups for p in group["params"]]
        )


def update_gradients(
    policy: Policy, objective, teacher: LocalTeacher, batch, batching: MicroBatching
):
    """The gradient of one optimizer step of :func:`policy_update` on ``batch``, and the student's
    and teacher's log-probs, with the student's and teacher's forwards packed as ``batching``
    says."""
    training = TrainingConfig(objective=objective, max_grad_norm=None, temperature=0.8)
    policy.use_packing(batching.packed)
    teacher.module.packed = batching.packed
    request = objective.teacher_request(training.temperature)
    inputs = TeacherInput(batch.input_ids_BT, batch.attention_mask_BT, batch.mask_BT.bool())
    scores = teacher.score(inputs, request or TeacherRequest())
    advantages = objective.advantages(
        batch.sampled_logprobs_BT, scores, batch.mask_BT, policy_gradient(training)
    )
    if advantages is None:
        advantages = torch.zeros_like(batch.mask_BT)
    optimizer = RecordingOptimizer(policy.trainable_parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    stats = policy_update(
        policy, objective, optimizer, scheduler, batch, scores, advantages, training, batching
    )
    with torch.no_grad():
        logprobs, _ = policy.sequence_logprobs(
            batch.input_ids_BT, batch.attention_mask_BT, batch.mask_BT, temperature=0.8
        )
    return optimizer.gradients[0], stats, logprobs, scores


def objective_cases():
    """Every registered objective, with top-k small enough for the tiny vocabulary."""
    for name, cls in objectives().items():
        options = {"topk": 5} if "topk" in {f.name for f in dataclasses.fields(cls)} else {}
        yield pytest.param(name, options, id=name)


@pytest.mark.parametrize("lora_rank", [0, 4])
@pytest.mark.parametrize(("name", "options"), list(objective_cases()))
def test_packed_micro_batches_make_the_update_padded_ones_make(name, options, lora_rank):
    objective = objectives()[name](**options)
    student = model(1)
    if lora_rank:
        student = apply_lora(student, StudentConfig(model="tiny", lora_rank=lora_rank))
        with torch.no_grad():  # B = 0 at the start would leave every A without a gradient
            for name, parameter in student.named_parameters():
                if "lora_B" in name:
                    parameter.normal_(0.0, 0.1)
    policy = Policy(student, VOCAB)
    teacher = LocalTeacher(model(2), vocab_size=VOCAB, pad_id=0, batch_size=3)
    batch = rollouts()
    padded = update_gradients(policy, objective, teacher, batch, MicroBatching(packed=False))
    # 3 to 4 packed micro-batches of at most 40 tokens (rows of 2 to 30), teacher forwards too
    teacher.token_budget = 40
    bins = MicroBatching(tokens=40, packed=True)
    assert 3 <= len(bins.split(batch)) <= 4
    packed = update_gradients(policy, objective, teacher, batch, bins)

    mask = batch.mask_BT.bool()
    assert float((padded[2] - packed[2])[mask].abs().max()) < 1e-5  # the student's log-probs
    assert (
        float((padded[3].logprobs_BT - packed[3].logprobs_BT)[mask].abs().max()) < 1e-5
    )  # teacher's
    assert packed[1].loss == pytest.approx(padded[1].loss, rel=1e-5, abs=1e-7)
    assert packed[1].objective_value == pytest.approx(padded[1].objective_value, rel=1e-5, abs=1e-7)
    assert len(packed[0]) == len(padded[0]) and len(padded[0]) > 0
    for got, expected in zip(packed[0], padded[0], strict=True):
        scale = float(expected.abs().max())
        assert scale > 0
        assert float((got - expected).abs().max()) <= 1e-5 * scale


def test_a_model_that_cannot_pack_runs_padded_and_says_why():
    eager = model(1, attn_implementation="eager")
    assert "eager" in packing_problem(eager)
    policy = Policy(eager, VOCAB)
    assert "packing needs sdpa" in policy.use_packing(True) and not policy.packed
    windowed = model(1, sliding_window=4, use_sliding_window=True)
    assert "sliding-window" in packing_problem(windowed)
    assert policy.use_packing(False) is None


def test_a_budget_that_cannot_hold_the_longest_row_is_refused_naming_both(
    tmp_path, model_dirs, capsys
):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "".join(json.dumps({"prompt": "x" * n, "answer": "y"}) + "\n" for n in (3, 30, 8))
    )
    config = {
        "log_path": str(tmp_path / "run"),
        "student": {"model": str(model_dirs["student"])},
        "teacher": {"model": str(model_dirs["teacher"])},
        "datasets": [{"name": "d", "source": str(prompts), "groups_per_batch": 1, "group_size": 2}],
        "training": {"max_tokens": 16, "micro_batch_tokens": 40, "max_steps": 1},
    }
    path = tmp_path / "run.yaml"
    path.write_text(json.dumps(config))
    assert main(["train", str(path), "--no-progress"]) == 2
    error = capsys.readouterr().err
    assert "training.micro_batch_tokens: 40 tokens cannot hold the longest possible row" in error
    longest_prompt = int(error.split("the longest prompt, ")[1].split(" tokens")[0])
    assert (
        longest_prompt > 30
    )  # the 30-character prompt in the chat template, one token a character
    assert f"{longest_prompt + 16} tokens" in error and "max_tokens 16" in error
    assert "Traceback" not in error and not (tmp_path / "run").exists()


@torch.no_grad()
def test_a_model_routed_to_pack_runs_its_padded_forwards_as_before_and_saves_as_before(tmp_path):
    """Packing routes the model's sdpa through opd's per-sequence attention for as long as it
    packs: its padded forwards (a sampler's, left-padded: only the mask keeps padding out) must
    not change, nor what a saved model says of its attention."""
    student, batch = model(1), rollouts()
    body = backbone_and_head(student)[0]
    left = torch.zeros_like(batch.attention_mask_BT)
    left_ids = torch.zeros_like(batch.input_ids_BT)
    for row, length in enumerate(batch.attention_mask_BT.sum(-1).tolist()):
        left[row, -length:] = 1
        left_ids[row, -length:] = batch.input_ids_BT[row, :length]
    expected = body(input_ids=left_ids, attention_mask=left).last_hidden_state
    use_packed_attention(student)
    assert student.config._attn_implementation == "opd_packed_sdpa"
    routed = body(input_ids=left_ids, attention_mask=left).last_hidden_state
    assert float((routed - expected)[left.bool()].abs().max()) < 1e-6
    student.save_pretrained(tmp_path)
    assert "opd_packed" not in (tmp_path / "config.json").read_text()
    use_packed_attention(student, False)
    assert student.config._attn_implementation == "sdpa"


def test_gradient_checkpointing_recomputes_packed_layers_per_sequence():
    """A checkpointed layer is recomputed in backward, after the packed forward returned: it must
    still keep the sequences apart (the gradient equals the padded one)."""
    objective = objectives()["sampled_reverse_kl"]()
    student = model(1)
    student.gradient_checkpointing_enable()
    policy = Policy(student, VOCAB)
    teacher = LocalTeacher(model(2), vocab_size=VOCAB, pad_id=0, batch_size=3)
    batch = rollouts()
    padded = update_gradients(policy, objective, teacher, batch, MicroBatching(packed=False))
    packed = update_gradients(
        policy, objective, teacher, batch, MicroBatching(tokens=40, packed=True)
    )
    for got, expected in zip(packed[0], padded[0], strict=True):
        assert float((got - expected).abs().max()) <= 1e-5 * float(expected.abs().max())
