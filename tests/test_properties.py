"""Invariants of the pure math, on generated shapes, padding patterns, dtypes and extreme values.

Each property is checked against an independent expectation: a naive reference written the
plain way (``tests/reference.py`` or inline), a symmetry (permuting rows permutes results,
chunk size and padding change nothing), or a fixed point (a teacher equal to the student
gives 0). The ``ci`` hypothesis profile (tests/conftest.py) runs a fixed set of examples;
``HYPOTHESIS_PROFILE=campaign`` runs many more (docs/reliability.md).
"""

from __future__ import annotations

import itertools
import math
import random

import torch
from hypothesis import assume, example, given
from hypothesis import strategies as st
from torch import nn

from opd.demo.char_tokenizer import build_char_tokenizer
from opd.logprobs import selected_token_logprobs, sequence_logprobs
from opd.objectives.advantages import discounted_future_sum, kl_advantages
from opd.objectives.jsd_head import chunked_jsd
from opd.objectives.k3 import k3_kl_token_estimate
from opd.objectives.policy_losses import POLICY_LOSSES, aggregate
from opd.objectives.topk_head import chunked_topk_forward_kl
from opd.teachers.alignment import character_logprobs, student_token_logprobs, token_char_ends
from tests.conftest import tiny_llama
from tests.reference import generalized_jsd, topk_forward_kl

seeds = st.integers(0, 2**31 - 1)
scales = st.sampled_from([1e-4, 1.0, 30.0])  # near-uniform, ordinary, and saturated logits


def head_case(seed: int, rows: int, vocab: int, dim: int, scale: float):
    """Random hidden states, an lm head and token ids, reproducible from ``seed``."""
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(rows, dim, generator=generator, dtype=torch.float64).float() * scale
    head = nn.Linear(dim, vocab, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(vocab, dim, generator=generator))
    ids = torch.randint(0, vocab, (rows,), generator=generator)
    return hidden, head, ids


def naive_log_softmax(hidden: torch.Tensor, head: nn.Linear) -> torch.Tensor:
    return torch.log_softmax((hidden.double() @ head.weight.double().T), dim=-1)


@given(seeds, st.integers(0, 40), st.integers(2, 50), st.integers(1, 45), scales)
@example(4342481, 35, 44, 1, 30.0)  # saturated logits: float32 error above a fixed 1e-5 (campaign)
def test_selected_logprobs_equal_the_naive_ones_whatever_the_chunk_size(
    seed, rows, vocab, chunk, scale
):
    hidden, head, ids = head_case(seed, rows, vocab, 8, scale)
    hidden.requires_grad_(True)
    logprobs, entropy = selected_token_logprobs(hidden, head, ids, chunk_size=chunk)
    reference = naive_log_softmax(hidden, head)
    expected = reference.gather(-1, ids[:, None]).squeeze(-1)
    # float32 against float64: a log-softmax is exact to a few float32 ulps of the largest logit
    largest_logit = float((hidden.double() @ head.weight.double().T).abs().max()) if rows else 0.0
    precision = 1e-5 + 8 * torch.finfo(torch.float32).eps * largest_logit
    torch.testing.assert_close(logprobs.double(), expected, atol=precision, rtol=1e-5)
    naive_entropy = -(reference.exp() * reference).sum(-1)
    torch.testing.assert_close(entropy.double(), naive_entropy, atol=1e-4, rtol=1e-4)
    if rows:
        weights = torch.linspace(-1, 1, rows)
        (grad,) = torch.autograd.grad((logprobs * weights).sum(), hidden)
        plain = hidden.detach().double().requires_grad_(True)
        (naive_grad,) = torch.autograd.grad(
            (
                naive_log_softmax(plain, head).gather(-1, ids[:, None]).squeeze(-1)
                * weights.double()
            ).sum(),
            plain,
        )
        torch.testing.assert_close(grad.double(), naive_grad, atol=1e-4, rtol=1e-4)


@given(seeds, st.integers(1, 30), st.integers(1, 30))
def test_permuting_rows_permutes_the_logprobs(seed, rows, chunk):
    hidden, head, ids = head_case(seed, rows, 17, 8, 1.0)
    order = torch.randperm(rows, generator=torch.Generator().manual_seed(seed))
    whole, _ = selected_token_logprobs(hidden, head, ids, chunk_size=chunk)
    permuted, _ = selected_token_logprobs(hidden[order], head, ids[order], chunk_size=chunk)
    torch.testing.assert_close(permuted, whole[order], atol=1e-5, rtol=1e-6)


@given(
    seeds,
    st.integers(1, 25),
    st.integers(2, 40),
    st.integers(1, 30),
    st.sampled_from([0.0, 0.1, 0.5, 0.9, 1.0]),
    scales,
)
def test_chunked_jsd_equals_the_naive_generalized_jsd(seed, rows, vocab, chunk, beta, scale):
    hidden, head, ids = head_case(seed, rows, vocab, 8, scale)
    teacher_hidden, teacher_head, _ = head_case(seed + 1, rows, vocab, 8, scale)
    loss, _, _ = chunked_jsd(
        hidden, head, ids, teacher_hidden, teacher_head, beta, chunk_size=chunk
    )
    expected = generalized_jsd(
        naive_log_softmax(hidden, head), naive_log_softmax(teacher_hidden, teacher_head), beta
    )
    torch.testing.assert_close(loss.double(), expected, atol=1e-4, rtol=1e-4)
    assert (loss >= -1e-5).all()
    same, _, _ = chunked_jsd(hidden, head, ids, hidden, head, beta, chunk_size=chunk)
    assert same.abs().max() <= 1e-5  # a teacher equal to the student costs nothing


@given(
    seeds, st.integers(1, 25), st.integers(2, 40), st.integers(1, 40), st.integers(1, 30), scales
)
def test_chunked_topk_forward_kl_equals_the_naive_one(seed, rows, vocab, k, chunk, scale):
    k = min(k, vocab)
    hidden, head, ids = head_case(seed, rows, vocab, 8, scale)
    teacher_hidden, teacher_head, _ = head_case(seed + 1, rows, vocab, 8, scale)
    teacher_top = naive_log_softmax(teacher_hidden, teacher_head).float().topk(k, dim=-1)
    loss, _, _ = chunked_topk_forward_kl(
        hidden, head, ids, teacher_top.indices, teacher_top.values, chunk_size=chunk
    )
    expected = topk_forward_kl(
        naive_log_softmax(hidden, head).float(), teacher_top.indices, teacher_top.values
    )
    torch.testing.assert_close(loss, expected, atol=2e-4, rtol=1e-4)
    student_top = naive_log_softmax(hidden, head).float().topk(k, dim=-1)
    same, _, _ = chunked_topk_forward_kl(hidden, head, ids, student_top.indices, student_top.values)
    assert same.abs().max() <= 1e-4


@st.composite
def masked_batches(draw, dtypes=(torch.float32, torch.float64)):
    """(values, second values, mask) of a random (B, T) with random padding and empty rows."""
    batch, length = draw(st.integers(1, 6)), draw(st.integers(1, 12))
    seed = draw(seeds)
    generator = torch.Generator().manual_seed(seed)
    dtype = draw(st.sampled_from(dtypes))
    magnitude = draw(st.sampled_from([1e-6, 1.0, 50.0]))
    first = (torch.randn(batch, length, generator=generator, dtype=torch.float64) * magnitude).to(
        dtype
    )
    second = (torch.randn(batch, length, generator=generator, dtype=torch.float64) * magnitude).to(
        dtype
    )
    lengths = [draw(st.integers(0, length)) for _ in range(batch)]  # 0: an empty row
    left = draw(st.booleans())
    mask = torch.zeros(batch, length, dtype=dtype)
    for row, n in enumerate(lengths):
        if left:
            mask[row, length - n :] = 1
        else:
            mask[row, :n] = 1
    return first, second, mask


@given(masked_batches(), st.floats(0.0, 1.0), st.floats(0.0, 3.0))
def test_kl_advantages_match_a_naive_reverse_scan(batch, gamma, coef):
    student, teacher, mask = batch
    advantages = kl_advantages(
        student, teacher, mask, kl_penalty_coef=coef, kl_discount_factor=gamma
    )
    rows, length = student.shape
    expected = torch.zeros(rows, length, dtype=torch.float64)
    for row in range(rows):
        for t in range(length):
            if not mask[row, t]:
                continue
            if gamma > 0:
                expected[row, t] = sum(
                    gamma ** (u - t)
                    * -coef
                    * float(mask[row, u])
                    * float(student[row, u] - teacher[row, u])
                    for u in range(t, length)
                )
            else:
                expected[row, t] = -coef * float(student[row, t] - teacher[row, t])
    scale = max(1.0, float(expected.abs().max()))
    tolerance = 1e-4 if student.dtype == torch.float32 else 1e-9
    torch.testing.assert_close(
        advantages.double(), expected, atol=tolerance * scale * length, rtol=0
    )
    assert (advantages[mask == 0] == 0).all()  # padding never carries an advantage
    same = kl_advantages(student, student, mask, kl_penalty_coef=coef, kl_discount_factor=gamma)
    assert (same == 0).all()  # a teacher equal to the student gives no signal


@given(masked_batches(), st.floats(0.0, 1.0))
def test_discounting_is_linear_and_the_identity_at_zero(batch, gamma):
    first, second, _ = batch
    torch.testing.assert_close(discounted_future_sum(first, 0.0), first)
    combined = discounted_future_sum(first + 2 * second, gamma)
    separate = discounted_future_sum(first, gamma) + 2 * discounted_future_sum(second, gamma)
    scale = max(1.0, float(combined.abs().max()))
    torch.testing.assert_close(combined, separate, atol=1e-5 * scale, rtol=1e-5)


@given(masked_batches(dtypes=(torch.float64,)), st.sampled_from(sorted(POLICY_LOSSES)))
def test_every_policy_loss_has_the_reinforce_gradient_on_policy(batch, loss_fn):
    """At ratio 1 (the first substep of on-policy data) every loss's gradient is ``-A * d logp``."""
    logp, advantages, mask = batch
    logp = -logp.abs()  # log-probs are <= 0
    theta = logp.clone().requires_grad_(True)
    loss = POLICY_LOSSES[loss_fn](theta, logp, advantages, {})
    (grad,) = torch.autograd.grad((loss * mask).sum(), theta)
    torch.testing.assert_close(grad, -advantages * mask, atol=1e-9, rtol=1e-9)


@given(masked_batches(), st.sampled_from(["sum", "token_mean", "sequence_mean"]))
def test_aggregation_matches_its_definition_and_ignores_row_order(batch, how):
    loss, _, mask = batch
    tokens, sequences = int(mask.sum()), loss.shape[0]
    value = aggregate(loss, mask, how, tokens, sequences)
    rows = [
        [float(loss[r, t]) for t in range(loss.shape[1]) if mask[r, t]]
        for r in range(loss.shape[0])
    ]
    if how == "sum":
        expected = sum(sum(r) for r in rows)
    elif how == "token_mean":
        expected = sum(sum(r) for r in rows) / max(tokens, 1)
    else:
        expected = sum(sum(r) / len(r) for r in rows if r) / sequences
    scale = max(1.0, abs(expected), float(loss.abs().max()))
    assert math.isclose(float(value), expected, abs_tol=1e-5 * scale)
    flipped = aggregate(loss.flip(0), mask.flip(0), how, tokens, sequences)
    assert math.isclose(float(flipped), float(value), abs_tol=1e-5 * scale)


@given(masked_batches(dtypes=(torch.float64,)))
def test_k3_is_nonnegative_and_zero_only_at_equality(batch):
    first, second, _ = batch
    estimate = k3_kl_token_estimate(first.clamp(-30, 0), second.clamp(-30, 0))
    assert (estimate >= 0).all()
    assert (k3_kl_token_estimate(first, first) == 0).all()


@given(seeds, st.integers(1, 4), st.integers(2, 14), st.booleans(), st.sampled_from([1, 3, 1024]))
def test_a_rows_logprobs_do_not_depend_on_its_padding_or_batch(seed, rows, length, left, chunk):
    """A sequence scores the same alone, padded on either side, or batched with longer ones."""
    model = tiny_llama(23, seed=seed % 7, layers=1, hidden=16)
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, length + 1, (rows,), generator=generator).tolist()
    sequences = [torch.randint(3, 23, (n,), generator=generator).tolist() for n in lengths]
    width = max(lengths) + 2
    ids = torch.zeros(rows, width, dtype=torch.long)
    attention = torch.zeros(rows, width, dtype=torch.long)
    for row, sequence in enumerate(sequences):
        start = width - len(sequence) if left else 0
        ids[row, start : start + len(sequence)] = torch.tensor(sequence)
        attention[row, start : start + len(sequence)] = 1
    score = attention.clone()
    score[:, 0] = 0
    with torch.no_grad():
        batched, _ = sequence_logprobs(model, ids, attention, score, chunk_size=chunk)
        for row, sequence in enumerate(sequences):
            alone_ids = torch.tensor([sequence])
            alone_mask = torch.ones_like(alone_ids)
            alone_score = alone_mask.clone()
            alone_score[:, 0] = 0
            alone, _ = sequence_logprobs(model, alone_ids, alone_mask, alone_score)
            start = width - len(sequence) if left else 0
            got = batched[row, start + 1 : start + len(sequence)]
            torch.testing.assert_close(got, alone[0, 1:], atol=1e-5, rtol=1e-5)


_char_tokenizer = build_char_tokenizer()


@given(
    st.lists(st.integers(1, 4), min_size=1, max_size=8),
    st.lists(st.integers(1, 4), min_size=1, max_size=12),
    st.integers(0, 2**32 - 1),
)
def test_character_logprobs_never_reward_and_sum_to_the_teachers_paths(
    teacher_pieces, student_pieces, seed
):
    """Any teacher segmentation and likely tokens: a character's log-prob is <= 0, and a
    completion's total is the teacher's tokens' log-prob plus, at each token end, the log of
    (ending there and going on with the next character + a longer token going on with it) over
    (ending there and going on with it); any student segmentation sums to the same."""
    rng = random.Random(seed)
    text = "".join(rng.choice("ab") for _ in range(sum(teacher_pieces)))
    offsets = list(itertools.pairwise([0, *_running(teacher_pieces)]))
    owns = [math.log(rng.uniform(0.01, 0.5)) for _ in offsets]
    alternatives = []
    for own in owns:
        spare = 1.0 - math.exp(own)  # the others share at most what the token leaves
        weights = [rng.random() for _ in range(4)]
        alternatives.append(
            [
                (
                    "".join(rng.choice("ab") for _ in range(rng.randint(1, 3))),
                    math.log(spare * w / (sum(weights) + 1)),
                )
                for w in weights
            ]
        )
    chars, end = character_logprobs(text, offsets, owns, alternatives)
    assert all(value <= 1e-12 for value in [*chars, end])
    expected = sum(owns)
    for t in range(1, len(offsets)):
        a, b = offsets[t - 1]
        nxt = text[b]
        first = math.exp(owns[t]) + sum(
            math.exp(lp) for o, lp in alternatives[t] if o.startswith(nxt)
        )
        ending = math.exp(owns[t - 1]) * first
        longer = sum(math.exp(lp) for o, lp in alternatives[t - 1] if o.startswith(text[a:b] + nxt))
        expected += math.log((ending + longer) / ending)
    assert math.isclose(sum(chars) + end, expected, abs_tol=1e-9)
    student_ends = [min(e, len(text)) for e in _running(student_pieces)]
    student_ends[-1] = len(text)
    view = student_token_logprobs(chars, student_ends, [0.0] * len(student_ends))
    assert math.isclose(sum(view), sum(chars), abs_tol=1e-9)


def _running(pieces: list[int]) -> list[int]:
    ends, total = [], 0
    for piece in pieces:
        total += piece
        ends.append(total)
    return ends


@given(st.text(alphabet="abcdefgh xyz0123456789+=", min_size=1, max_size=30))
def test_token_char_ends_end_at_the_decoded_length(text):
    ids = _char_tokenizer(text, add_special_tokens=False)["input_ids"]
    assume(ids)
    ends = token_char_ends(_char_tokenizer, ids)
    assert ends == sorted(ends)
    assert ends[-1] == len(_char_tokenizer.decode(ids))
