"""The sampler's recorded log-probs, stopping, and the masks built from its completions."""

import random

import pytest
import torch
from transformers import PreTrainedTokenizerFast

from opd.data.render import ChatRenderer
from opd.data.sequences import build_rollout_batch
from opd.logprobs import sequence_logprobs
from opd.sampling.base import Completion
from opd.sampling.hf_generate import HFGenerateSampler
from opd.sampling.seeded import inverse_cdf_sample
from tests.conftest import tiny_llama


@pytest.fixture
def setup(char_tokenizer):
    model = tiny_llama(len(char_tokenizer), seed=7)
    renderer = ChatRenderer(char_tokenizer)
    sampler = HFGenerateSampler(model, char_tokenizer, stop_token_ids=renderer.stop_token_ids)
    prompts = [
        renderer.prompt_ids([{"role": "user", "content": q}]) for q in ("ab", "reverse hello", "x")
    ]
    return model, renderer, sampler, prompts


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_recorded_logprobs_equal_trainer_recomputation(setup, temperature):
    model, _, sampler, prompts = setup
    torch.manual_seed(0)
    completions = sampler.sample(prompts * 2, temperature=temperature, max_tokens=12)
    batch = build_rollout_batch(prompts * 2, completions, [0] * 6, pad_id=0)
    with torch.no_grad():
        recomputed, _ = sequence_logprobs(
            model,
            batch.input_ids_BT,
            batch.attention_mask_BT,
            batch.mask_BT,
            temperature=temperature,
        )
    mask = batch.mask_BT.bool()
    assert mask.sum() > 20
    torch.testing.assert_close(recomputed[mask], batch.sampled_logprobs_BT[mask], atol=1e-4, rtol=0)
    # so the first importance ratio is 1
    ratio = torch.exp(recomputed[mask] - batch.sampled_logprobs_BT[mask])
    torch.testing.assert_close(ratio, torch.ones_like(ratio), atol=1e-4, rtol=0)


def test_model_generation_defaults_do_not_change_the_sampled_distribution(setup):
    """A checkpoint's generation_config (repetition penalty, forced length) must not leak in."""
    model, _, sampler, prompts = setup
    model.generation_config.repetition_penalty = 3.0
    model.generation_config.min_new_tokens = 8
    model.generation_config.top_k = 2
    torch.manual_seed(0)
    completions = sampler.sample(prompts * 2, temperature=1.0, max_tokens=10)
    batch = build_rollout_batch(prompts * 2, completions, [0] * 6, pad_id=0)
    with torch.no_grad():
        recomputed, _ = sequence_logprobs(
            model, batch.input_ids_BT, batch.attention_mask_BT, batch.mask_BT
        )
    mask = batch.mask_BT.bool()
    torch.testing.assert_close(recomputed[mask], batch.sampled_logprobs_BT[mask], atol=1e-4, rtol=0)
    assert model.generation_config.repetition_penalty == 3.0  # restored afterwards


def test_completions_stop_at_end_of_turn_or_are_marked_truncated(setup, char_tokenizer):
    model, renderer, sampler, prompts = setup
    eos = renderer.stop_token_ids[0]
    with torch.no_grad():
        model.lm_head.weight[eos] += 3.0  # make stopping likely
    torch.manual_seed(1)
    completions = sampler.sample(prompts * 4, temperature=1.0, max_tokens=5)
    assert any(c.finished for c in completions)
    for c in completions:
        assert len(c.token_ids) == len(c.logprobs) <= 5
        if c.finished:
            assert c.token_ids[-1] == eos and eos not in c.token_ids[:-1]
        else:
            assert len(c.token_ids) == 5 and eos not in c.token_ids


def test_greedy_is_deterministic(setup):
    _, _, sampler, prompts = setup
    a = sampler.sample(prompts, temperature=1.0, max_tokens=6, greedy=True)
    b = sampler.sample(prompts, temperature=1.0, max_tokens=6, greedy=True)
    assert [c.token_ids for c in a] == [c.token_ids for c in b]


def test_generation_config_passes_strict_validation(setup):
    """No field generate would ignore or warn about (top_k 0 once warned on every greedy eval)."""
    _, _, sampler, _ = setup
    sampler.generation_config(max_tokens=4).validate(strict=True)


def test_inverse_cdf_takes_the_token_whose_interval_holds_the_draw():
    # cdf 0.1, 0.1, 0.7, 1.0 (token 1 has no width); rows unnormalised by 2 in the second half
    probs = torch.tensor([[0.1, 0.0, 0.6, 0.3]] * 4 + [[0.2, 0.0, 1.2, 0.6]] * 4)
    uniform = torch.tensor([0.0, 0.0999, 0.1, 0.9999] * 2)
    assert inverse_cdf_sample(probs, uniform).tolist() == [0, 0, 2, 3] * 2
    no_distribution = torch.full((1, 4), float("nan"))
    assert inverse_cdf_sample(no_distribution, torch.tensor([0.5])).tolist() == [3]


def test_a_model_with_nan_logits_yields_nan_logprobs_instead_of_crashing(setup):
    model, _, sampler, prompts = setup
    with torch.no_grad():
        model.lm_head.weight[3, 0] = float("nan")
    completions = sampler.sample(prompts, temperature=1.0, max_tokens=3)
    assert all(
        len(c.token_ids) == 3 and c.token_ids[0] < len(sampler.tokenizer) for c in completions
    )
    assert all(torch.isnan(torch.tensor(c.logprobs[0])) for c in completions)


def test_sampled_first_tokens_follow_the_softmax_of_the_logits(setup):
    """Frequencies of 20000 draws sit within 5 standard errors of softmax(logits / T)."""
    model, _, sampler, prompts = setup
    draws, temperature = 20000, 0.8
    torch.manual_seed(0)
    completions = sampler.sample(prompts[:1] * draws, temperature=temperature, max_tokens=1)
    first_tokens = torch.tensor([c.token_ids[0] for c in completions])
    counts = torch.bincount(first_tokens, minlength=len(sampler.tokenizer))
    with torch.no_grad():
        logits = model(torch.tensor([prompts[0]])).logits[0, -1, : len(sampler.tokenizer)]
    expected = torch.softmax(logits / temperature, -1).double()
    assert expected.max() < 0.9 and (expected > 0.01).sum() >= 3  # not one near-certain token
    frequency = counts.double() / draws
    standard_error = (expected * (1 - expected) / draws).sqrt()
    assert ((frequency - expected).abs() <= 5 * standard_error + 1e-4).all()


def test_greedy_picks_the_argmax_despite_model_generation_defaults(setup):
    model, _, sampler, prompts = setup
    model.generation_config.repetition_penalty = 3.0
    (completion,) = sampler.sample(prompts[1:2], temperature=0.7, max_tokens=6, greedy=True)
    ids = list(prompts[1])
    with torch.no_grad():
        for token in completion.token_ids:
            assert token == int(model(torch.tensor([ids])).logits[0, -1].argmax())
            ids.append(token)


def test_masks_cover_exactly_the_completion_including_eos():
    prompts = [[1, 5, 6], [1, 7]]
    completions = [
        Completion([9, 10, 2], [-0.1, -0.2, -0.3], True),
        Completion([11], [-0.4], False),
    ]
    batch = build_rollout_batch(prompts, completions, [0, 1], pad_id=0)
    assert batch.input_ids_BT.tolist() == [[1, 5, 6, 9, 10, 2], [1, 7, 11, 0, 0, 0]]
    assert batch.mask_BT.tolist() == [[0, 0, 0, 1, 1, 1], [0, 0, 1, 0, 0, 0]]
    assert batch.attention_mask_BT.tolist() == [[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0]]
    assert batch.sampled_logprobs_BT[0, 3:].tolist() == pytest.approx([-0.1, -0.2, -0.3])
    assert batch.sampled_logprobs_BT[1].tolist() == pytest.approx([0, 0, -0.4, 0, 0, 0])
    assert batch.finished_B.tolist() == [True, False]
    assert batch.sequences == [[1, 5, 6, 9, 10, 2], [1, 7, 11]]


def test_plain_renderer_stop_string_cuts_the_completion(char_tokenizer):
    from opd.demo.char_tokenizer import build_char_tokenizer

    tokenizer = build_char_tokenizer(chat_template=None)
    sampler = HFGenerateSampler(
        tiny_llama(len(tokenizer)), tokenizer, stop_token_ids=[2], stop_strings=["\n\nUser:"]
    )
    ids = tokenizer("ab\n\nUser: more", add_special_tokens=False)["input_ids"]
    cut = sampler._cut(ids, [0.0] * len(ids))
    assert tokenizer.decode(cut.token_ids) == "ab\n\nUser:" and cut.finished


def _head_products(model, sampler, prompts) -> list[str]:
    """The matmul-family ops the sampler ran with the lm head's weight as an operand."""
    vocab, hidden = model.get_output_embeddings().weight.shape
    head_shapes = ([hidden, vocab], [vocab, hidden])
    with torch.profiler.profile(record_shapes=True) as profile:
        sampler.sample(prompts, temperature=1.0, max_tokens=3)
    return [
        event.name
        for event in profile.events()
        if event.name in ("aten::mm", "aten::bmm")
        and any(list(shape[-2:]) in head_shapes for shape in event.input_shapes if shape)
    ]


def test_a_frozen_head_is_never_multiplied_by_a_batch_expanded_copy_of_its_weight(setup):
    """The prefill feeds the head a strided slice; without a contiguous input torch.matmul would
    broadcast a frozen weight to (batch, hidden, vocab) and copy it (0.36 s a rollout for
    SmolLM2)."""
    model, _, sampler, prompts = setup
    model.requires_grad_(False)
    products = _head_products(model, sampler, prompts * 3)
    assert products and set(products) == {"aten::mm"}
    assert not model.get_output_embeddings()._forward_pre_hooks  # the hook is gone afterwards


@pytest.mark.parametrize("kind", ["byte_level", "metaspace"])
def test_a_stop_string_is_found_at_the_token_that_ends_it_as_decoding_everything_finds_it(kind):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from opd.sampling.base import ends_in_stop_string

    text = ["Usuário: olá 🙂 café\n\nUser: done ✓ naïve 日本語 end", "a b\n\nUser:x 🙂🙂 ü"] * 40
    backend = Tokenizer(models.BPE())
    if kind == "byte_level":  # multi-byte characters split over tokens
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        backend.decoder = decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    else:  # a decoder that drops the first token's leading space
        backend.pre_tokenizer = pre_tokenizers.Metaspace()
        backend.decoder = decoders.Metaspace()
        alphabet = []
    backend.train_from_iterator(
        text, trainers.BpeTrainer(vocab_size=300, initial_alphabet=alphabet)
    )
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend)
    stops = ["\n\nUser:", "🙂 c", " end", "ï"]
    generator = random.Random(0)
    found = 0
    for _ in range(200):
        ids = [generator.randrange(len(tokenizer)) for _ in range(60)]
        ids[20:20] = tokenizer(generator.choice(text), add_special_tokens=False)["input_ids"]
        naive = next(
            (
                e
                for e in range(1, len(ids) + 1)
                if any(s in tokenizer.decode(ids[:e]) for s in stops)
            ),
            None,
        )
        tail = next(
            (e for e in range(1, len(ids) + 1) if ends_in_stop_string(tokenizer, ids[:e], stops)),
            None,
        )
        assert tail == naive, (ids, naive, tail)
        found += naive is not None
    assert found > 150
