"""``opd serve``'s continuous batching, in process: rows that arrive while others decode join the
running batch (fewer forwards than decoding apart, counted) and get the tokens and log-probs
opd's own sampler gives each of them alone, whatever their settings; a model whose cache cannot
be left-padded (a sliding window) starts newcomers only once the batch has ended, with the same
answers."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from transformers import MistralConfig, MistralForCausalLM

from opd.sampling.hf_generate import HFGenerateSampler
from opd.serve.model import ScoringModel
from tests.conftest import tiny_llama

EXTRA = 8
"""The models below have this many ids past the tokenizer's, which no sampler draws (their logits
are set to -inf): a stop id there never ends a row, so every row runs to its ``max_tokens``."""


class Gate:
    """Counts the model's forwards, and at given counts lets the next request go and holds the
    decode until that request has reached the batcher: newcomers arrive mid-decode on any
    machine, however fast."""

    def __init__(self, scorer, release_at: list[int]):
        self.scorer = scorer
        self.count = 0
        self.release_at = release_at
        self.go = [threading.Event() for _ in range(len(release_at) + 1)]
        self.go[0].set()
        scorer.teacher.model.register_forward_pre_hook(self._seen)

    def _seen(self, *_):
        self.count += 1
        if self.count in self.release_at:
            released = self.go[self.release_at.index(self.count) + 1]
            released.set()
            deadline = time.monotonic() + 30
            while not self.scorer.batcher.arrived and time.monotonic() < deadline:
                time.sleep(0.001)

    def send(self, requests):
        """Each of ``requests`` (sample() arguments) from its own thread, once let go."""
        answers = [None] * len(requests)

        def send(index):
            self.go[index].wait(timeout=60)
            answers[index] = self.scorer.sample(*requests[index])

        threads = [threading.Thread(target=send, args=(i,)) for i in range(len(requests))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
        return answers


def alone(model, tokenizer, request):
    """Each row of ``request`` sampled on its own by opd's sampler (``generate``)."""
    prompts, temperature, max_tokens, seeds, stops, strings = request
    sampler = HFGenerateSampler(
        model, tokenizer, stop_token_ids=stops, stop_strings=strings or None
    )
    return [
        sampler.sample(
            [prompt],
            temperature=temperature or 1.0,
            max_tokens=max_tokens,
            greedy=temperature == 0,
            seed=[seed],
        )[0]
        for prompt, seed in zip(prompts, seeds, strict=True)
    ]


def assert_same(got, want):
    assert got.token_ids == want.token_ids
    assert got.finished == want.finished
    assert got.logprobs == pytest.approx(want.logprobs, abs=1e-4)


def test_rows_that_arrive_while_others_decode_join_them_and_get_what_they_get_alone(
    char_tokenizer,
):
    model = tiny_llama(len(char_tokenizer) + EXTRA, seed=3).eval()
    never = len(char_tokenizer)
    stop_id = char_tokenizer.convert_tokens_to_ids("Z")
    requests = [
        ([[1, 6, 7]], 1.0, 60, [11], [never], []),
        ([[1, 8, 9, 10, 11, 12]], 1.0, 40, [12], [never], []),  # a longer prompt than the batch's
        ([[1, 9], [1, 13, 14]], 0.0, 30, [0, 0], [never], []),  # greedy, two rows
        ([[1, 10, 11]], 0.7, 25, [13], [never, stop_id], []),  # another temperature, a stop id
        ([[1, 12]], 1.0, 50, [14], [never], ["a"]),  # a stop string
    ]
    wanted = [alone(model, char_tokenizer, request) for request in requests]
    assert wanted[3][0].finished and wanted[4][0].finished  # the stop id and string end them
    scorer = ScoringModel(model, char_tokenizer, "teacher")
    gate = Gate(scorer, release_at=[3, 8, 13, 18])
    answers = gate.send(requests)
    for got, want in zip(answers, wanted, strict=True):
        assert len(got) == len(want)
        for completion, expected in zip(got, want, strict=True):
            assert_same(completion, expected)
    # apart, each request takes a forward per token of its longest row
    apart = sum(max(len(c.token_ids) for c in want) for want in wanted)
    assert gate.count < 0.5 * apart, (gate.count, apart)
    # closed, the loop's thread ends; a later request fails at once and scoring still answers
    assert scorer.batcher.thread.is_alive()
    scorer.close()
    assert not scorer.batcher.thread.is_alive()
    with pytest.raises(RuntimeError, match="closed"):
        scorer.sample([[1, 6]], 1.0, 5, [0], [], [])
    assert len(scorer.score([[1, 6, 7]], 2)) == 1


def test_a_sliding_window_model_starts_newcomers_after_the_batch_with_the_same_answers(
    char_tokenizer,
):
    torch.manual_seed(0)
    config = MistralConfig(
        vocab_size=len(char_tokenizer) + EXTRA,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        sliding_window=8,
        max_position_embeddings=256,
        pad_token_id=0,
        eos_token_id=2,
    )
    model = MistralForCausalLM(config).eval()
    never = len(char_tokenizer)
    requests = [([[1, 6 + i, 7]], 1.0, 20 + 5 * i, [100 + i], [never], []) for i in range(3)]
    wanted = [alone(model, char_tokenizer, request) for request in requests]
    scorer = ScoringModel(model, char_tokenizer, "teacher")
    gate = Gate(scorer, release_at=[3, 5])
    answers = gate.send(requests)
    for got, want in zip(answers, wanted, strict=True):
        assert_same(got[0], want[0])
    # the two newcomers decode together once the first request's 20 tokens are done
    assert gate.count == 20 + 30, gate.count
