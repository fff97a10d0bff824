"""The fused chunked top-k forward KL against autograd through the naive full-logits formula."""

import math

import pytest
import torch

from opd.logprobs import HeadGradients, LogitTransform
from opd.objectives.topk_head import chunked_topk_forward_kl
from tests.reference import topk_forward_kl

N, D, V, PADDED_V = 11, 6, 19, 23


def _naive(hidden, head, top_ids, top_log, transform):
    """Full (N, V) logits, the transform written out by hand, and topk_forward_kl."""
    z = (hidden.float() @ head.weight[:V].float().T) + (
        0 if head.bias is None else head.bias[:V].float()
    )
    z = z * transform.scale
    if transform.softcap is not None:
        z = transform.softcap * torch.tanh(z / transform.softcap)
    student_log = torch.log_softmax(z / transform.temperature, -1)
    return topk_forward_kl(student_log, top_ids, top_log), student_log


def _teacher_top(k, seed=0):
    generator = torch.Generator().manual_seed(seed)
    top = torch.log_softmax(torch.randn(N, V, generator=generator) * 2, -1).topk(k, -1)
    return top.indices, top.values


@pytest.mark.parametrize("k", [1, 5, V])
@pytest.mark.parametrize("chunk_size", [1, 4, 100])
@pytest.mark.parametrize("softcap", [None, 3.0])
def test_values_and_gradients_match_autograd_through_the_naive_formula(k, chunk_size, softcap):
    """k = V leaves the student no tail (floored): its term must drop out of the gradient."""
    torch.manual_seed(2)
    transform = LogitTransform(scale=0.7, softcap=softcap, temperature=0.9)
    hidden = torch.randn(N, D, requires_grad=True)
    head = torch.nn.Linear(D, PADDED_V, bias=True)
    ids = torch.randint(0, V, (N,))
    top_ids, top_log = _teacher_top(k)
    upstream = torch.randn(N)

    loss, selected, entropy = chunked_topk_forward_kl(
        hidden,
        head,
        ids,
        top_ids,
        top_log,
        chunk_size=chunk_size,
        transform=transform,
        vocab_size=V,
    )
    (loss * upstream).sum().backward()
    fused_grads = [hidden.grad.clone(), head.weight.grad.clone(), head.bias.grad.clone()]
    hidden.grad = None
    head.zero_grad()

    reference, student_log = _naive(hidden, head, top_ids, top_log, transform)
    (reference * upstream).sum().backward()
    torch.testing.assert_close(loss, reference, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(selected, student_log.gather(-1, ids[:, None]).squeeze(-1).detach())
    torch.testing.assert_close(entropy, -(student_log.exp() * student_log).sum(-1).detach())
    for fused, expected in zip(
        fused_grads, [hidden.grad, head.weight.grad, head.bias.grad], strict=True
    ):
        torch.testing.assert_close(fused, expected, atol=1e-5, rtol=1e-5)
    assert head.weight.grad[V:].abs().max() == 0  # the padded rows take no gradient


def test_gradient_by_hand():
    """One row, identity head: S W - T on the teacher's tokens, S (W - T_out / S_out) elsewhere."""
    logits = [0.0, 1.0, 2.0, 3.0]
    z = torch.tensor([logits], requires_grad=True)
    eye = torch.nn.Linear(4, 4, bias=False)
    with torch.no_grad():
        eye.weight.copy_(torch.eye(4))
    top_ids, top_probs = torch.tensor([[3, 1]]), torch.tensor([[0.5, 0.3]])  # teacher tail 0.2
    loss, _, _ = chunked_topk_forward_kl(z, eye, torch.tensor([0]), top_ids, top_probs.log())
    loss.backward()
    total = sum(math.exp(x) for x in logits)
    s = [math.exp(x) / total for x in logits]
    s_out = s[0] + s[2]
    expected = 0.5 * math.log(0.5 / s[3]) + 0.3 * math.log(0.3 / s[1]) + 0.2 * math.log(0.2 / s_out)
    assert loss.item() == pytest.approx(expected, rel=1e-5)
    by_hand = [s[0] * (1 - 0.2 / s_out), s[1] - 0.3, s[2] * (1 - 0.2 / s_out), s[3] - 0.5]
    torch.testing.assert_close(z.grad, torch.tensor([by_hand]), atol=1e-6, rtol=0)


def test_a_student_tail_below_the_floor_takes_no_gradient():
    """S_out = 2e^0 / (2e^0 + 2e^40) < TAIL_FLOOR: the floored tail is a constant, W = 0.5 + 0.3."""
    z = torch.tensor([[0.0, 0.0, 40.0, 40.0]], requires_grad=True)
    eye = torch.nn.Linear(4, 4, bias=False)
    with torch.no_grad():
        eye.weight.copy_(torch.eye(4))
    top_ids, top_log = torch.tensor([[3, 2]]), torch.tensor([[0.5, 0.3]]).log()
    loss, _, _ = chunked_topk_forward_kl(z, eye, torch.tensor([0]), top_ids, top_log)
    loss.backward()
    by_hand = torch.tensor([[0.0, 0.0, 0.5 * 0.8 - 0.3, 0.5 * 0.8 - 0.5]])
    torch.testing.assert_close(
        z.grad, by_hand, atol=1e-12, rtol=1e-5
    )  # outside: ~1e-18, not T_out S / S_out
    fused_grad = z.grad.clone()
    z.grad = None
    topk_forward_kl(torch.log_softmax(z, -1), top_ids, top_log).backward()
    torch.testing.assert_close(fused_grad, z.grad, atol=1e-12, rtol=1e-5)


def test_frozen_head_and_bfloat16_teacher_log_probs():
    """A LoRA student's frozen head gets no gradient; a server's log-probs may come in any float
    dtype."""
    torch.manual_seed(3)
    hidden = torch.randn(N, D, requires_grad=True)
    head = torch.nn.Linear(D, V, bias=False).requires_grad_(False)
    ids = torch.randint(0, V, (N,))
    top_ids, top_log = _teacher_top(4, seed=1)
    loss, _, _ = chunked_topk_forward_kl(
        hidden, head, ids, top_ids, top_log.bfloat16(), chunk_size=4
    )
    loss.sum().backward()
    fused_grad = hidden.grad.clone()
    hidden.grad = None

    reference, _ = _naive(hidden, head, top_ids, top_log.bfloat16().float(), LogitTransform())
    reference.sum().backward()
    assert head.weight.grad is None
    torch.testing.assert_close(loss, reference, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fused_grad, hidden.grad, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("chunk_size", "recomputed"), [(100, 0), (4, 2)])
def test_only_earlier_chunks_are_recomputed_and_a_second_backward_recomputes_all(
    monkeypatch, chunk_size, recomputed
):
    torch.manual_seed(5)
    hidden = torch.randn(N, D, requires_grad=True)
    head = torch.nn.Linear(D, V, bias=False)
    top_ids, top_log = _teacher_top(5, seed=2)
    calls, added = [], []
    rebuild, add = HeadGradients.logits, HeadGradients.add
    monkeypatch.setattr(
        HeadGradients, "logits", lambda self, *a: calls.append(a) or rebuild(self, *a)
    )
    monkeypatch.setattr(HeadGradients, "add", lambda self, *a: added.append(a[0]) or add(self, *a))
    loss, _, _ = chunked_topk_forward_kl(
        hidden, head, torch.zeros(N, dtype=torch.long), top_ids, top_log, chunk_size=chunk_size
    )
    loss.sum().backward(retain_graph=True)
    assert len(calls) == recomputed
    starts = list(range(0, N, chunk_size))
    assert (
        added == starts[-1:] + starts[:-1]
    )  # the kept chunk first: its buffer is freed before any rebuild
    loss.sum().backward()
    assert len(calls) == recomputed + -(-N // chunk_size)
    hidden_grad_twice = hidden.grad.clone()
    hidden.grad = None
    reference, _ = _naive(hidden, head, top_ids, top_log, LogitTransform())
    reference.sum().backward()
    torch.testing.assert_close(hidden_grad_twice, 2 * hidden.grad, atol=1e-5, rtol=1e-5)


def test_no_gradient_mode_gives_the_same_values():
    torch.manual_seed(6)
    hidden, head = torch.randn(N, D), torch.nn.Linear(D, V)
    ids = torch.randint(0, V, (N,))
    top_ids, top_log = _teacher_top(3, seed=3)
    with_grad = chunked_topk_forward_kl(hidden, head, ids, top_ids, top_log, chunk_size=4)
    with torch.no_grad():
        without = chunked_topk_forward_kl(hidden, head, ids, top_ids, top_log, chunk_size=4)
    for a, b in zip(with_grad, without, strict=True):
        torch.testing.assert_close(a.detach(), b)


def test_mismatched_rows_and_ids_outside_the_vocabulary_are_refused():
    head, ids = torch.nn.Linear(D, V), torch.zeros(3, dtype=torch.long)
    top_ids, top_log = torch.zeros(2, 4, dtype=torch.long), torch.zeros(2, 4)
    with pytest.raises(ValueError, match=r"both be \(3, k\)"):
        chunked_topk_forward_kl(torch.randn(3, D), head, ids, top_ids, top_log)
    with pytest.raises(ValueError, match=r"both be \(3, k\)"):
        chunked_topk_forward_kl(
            torch.randn(3, D), head, ids, torch.zeros(3, 4, dtype=torch.long), top_log
        )
    with pytest.raises(
        ValueError, match=f"teacher top-k id {V} is outside the model's vocabulary of {V}"
    ):
        chunked_topk_forward_kl(
            torch.randn(3, D), head, ids, torch.full((3, 4), V, dtype=torch.long), torch.zeros(3, 4)
        )
