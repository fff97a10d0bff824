"""The fused chunked JSD against autograd through the naive full-logits formula."""

import pytest
import torch

from opd.logprobs import HeadGradients, LogitTransform
from opd.objectives.jsd_head import chunked_jsd, chunked_jsd_mixed
from opd.teachers.base import HeadRows
from tests.reference import generalized_jsd

N, D, TEACHER_D, V, PADDED_V = 11, 6, 8, 19, 23


def _naive(hidden, head, teacher_hidden, teacher_head, beta, transform, teacher_transform):
    """Full (N, V) logits, the transforms written out by hand, and generalized_jsd."""

    def logits(h, linear, t):
        raw = (h.float() @ linear.weight[:V].float().T) + (
            0 if linear.bias is None else linear.bias[:V].float()
        )
        z = raw * t.scale
        if t.softcap is not None:
            z = t.softcap * torch.tanh(z / t.softcap)
        return z / t.temperature

    student_log = torch.log_softmax(logits(hidden, head, transform), -1)
    with torch.no_grad():
        teacher_log = torch.log_softmax(logits(teacher_hidden, teacher_head, teacher_transform), -1)
    return generalized_jsd(student_log, teacher_log, beta), student_log


@pytest.mark.parametrize("beta", [0.0, 0.4, 1.0])
@pytest.mark.parametrize("chunk_size", [1, 4, 100])
@pytest.mark.parametrize("softcap", [None, 3.0])
def test_values_and_gradients_match_autograd_through_the_naive_formula(beta, chunk_size, softcap):
    torch.manual_seed(2)
    transform = LogitTransform(scale=0.7, softcap=softcap, temperature=0.9)
    teacher_transform = LogitTransform(temperature=0.9)
    hidden = torch.randn(N, D, requires_grad=True)
    head = torch.nn.Linear(D, PADDED_V, bias=True)
    teacher_hidden = torch.randn(N, TEACHER_D) * 2
    teacher_head = torch.nn.Linear(TEACHER_D, PADDED_V, bias=False)
    ids = torch.randint(0, V, (N,))
    upstream = torch.randn(N)

    loss, selected, entropy = chunked_jsd(
        hidden,
        head,
        ids,
        teacher_hidden,
        teacher_head,
        beta,
        chunk_size=chunk_size,
        transform=transform,
        teacher_transform=teacher_transform,
        vocab_size=V,
    )
    (loss * upstream).sum().backward()
    fused_grads = [hidden.grad.clone(), head.weight.grad.clone(), head.bias.grad.clone()]
    hidden.grad = None
    head.zero_grad()

    reference, student_log = _naive(
        hidden, head, teacher_hidden, teacher_head, beta, transform, teacher_transform
    )
    (reference * upstream).sum().backward()
    torch.testing.assert_close(loss, reference, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(selected, student_log.gather(-1, ids[:, None]).squeeze(-1).detach())
    torch.testing.assert_close(entropy, -(student_log.exp() * student_log).sum(-1).detach())
    for fused, expected in zip(
        fused_grads, [hidden.grad, head.weight.grad, head.bias.grad], strict=True
    ):
        torch.testing.assert_close(fused, expected, atol=1e-5, rtol=1e-5)
    assert head.weight.grad[V:].abs().max() == 0  # the padded rows take no gradient


@pytest.mark.parametrize("beta", [0.0, 1.0])
def test_frozen_head_and_bfloat16_teacher(beta):
    """A LoRA student's frozen head gets no gradient; a bfloat16 teacher is scored in its own
    dtype."""
    torch.manual_seed(3)
    hidden = torch.randn(N, D, requires_grad=True)
    head = torch.nn.Linear(D, V, bias=False).requires_grad_(False)
    teacher_hidden = torch.randn(N, TEACHER_D, dtype=torch.bfloat16)
    teacher_head = torch.nn.Linear(TEACHER_D, V, bias=False).to(torch.bfloat16)
    ids = torch.randint(0, V, (N,))
    loss, _, _ = chunked_jsd(hidden, head, ids, teacher_hidden, teacher_head, beta, chunk_size=4)
    loss.sum().backward()
    fused_grad = hidden.grad.clone()
    hidden.grad = None

    teacher_log = torch.log_softmax((teacher_hidden @ teacher_head.weight.T).float(), -1)
    reference = generalized_jsd(torch.log_softmax(hidden @ head.weight.T, -1), teacher_log, beta)
    reference.sum().backward()
    assert head.weight.grad is None
    torch.testing.assert_close(loss, reference, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fused_grad, hidden.grad, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("beta", [0.0, 0.4, 1.0])
@pytest.mark.parametrize(("chunk_size", "recomputed"), [(100, 0), (4, 2)])
def test_only_earlier_chunks_are_recomputed_and_a_second_backward_recomputes_all(
    monkeypatch, beta, chunk_size, recomputed
):
    torch.manual_seed(5)
    hidden = torch.randn(N, D, requires_grad=True)
    head = torch.nn.Linear(D, V, bias=False)
    teacher_hidden = torch.randn(N, TEACHER_D)
    teacher_head = torch.nn.Linear(TEACHER_D, V, bias=False)
    calls, added = [], []
    rebuild, add = HeadGradients.logits, HeadGradients.add
    monkeypatch.setattr(
        HeadGradients, "logits", lambda self, *a: calls.append(a) or rebuild(self, *a)
    )
    monkeypatch.setattr(HeadGradients, "add", lambda self, *a: added.append(a[0]) or add(self, *a))
    loss, _, _ = chunked_jsd(
        hidden,
        head,
        torch.zeros(N, dtype=torch.long),
        teacher_hidden,
        teacher_head,
        beta,
        chunk_size=chunk_size,
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
    reference, _ = _naive(
        hidden, head, teacher_hidden, teacher_head, beta, LogitTransform(), LogitTransform()
    )
    reference.sum().backward()
    torch.testing.assert_close(hidden_grad_twice, 2 * hidden.grad, atol=1e-5, rtol=1e-5)


def test_no_gradient_mode_gives_the_same_values():
    torch.manual_seed(6)
    hidden, teacher_hidden = torch.randn(N, D), torch.randn(N, TEACHER_D)
    head, teacher_head = torch.nn.Linear(D, V), torch.nn.Linear(TEACHER_D, V)
    ids = torch.randint(0, V, (N,))
    with_grad = chunked_jsd(hidden, head, ids, teacher_hidden, teacher_head, 0.0, chunk_size=4)
    with torch.no_grad():
        without = chunked_jsd(hidden, head, ids, teacher_hidden, teacher_head, 0.0, chunk_size=4)
    for a, b in zip(with_grad, without, strict=True):
        torch.testing.assert_close(a.detach(), b)


def test_forward_kl_gradient_by_hand():
    """One row, identity head: d KL(T || S) / d z = S - T, with S = softmax(z)."""
    z = torch.tensor([[0.0, 1.0, 2.0]], requires_grad=True)
    teacher = torch.tensor([[0.2, 0.3, 0.5]])
    eye = torch.nn.Linear(3, 3, bias=False)
    with torch.no_grad():
        eye.weight.copy_(torch.eye(3))
    loss, _, _ = chunked_jsd(z, eye, torch.tensor([0]), teacher.log(), eye, 0.0)
    loss.backward()
    s = torch.exp(torch.tensor([0.0, 1.0, 2.0])) / torch.exp(torch.tensor([0.0, 1.0, 2.0])).sum()
    expected = (teacher * (teacher.log() - s.log())).sum()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
    torch.testing.assert_close(z.grad, (s - teacher), atol=1e-6, rtol=0)


def test_mismatched_rows_and_vocabularies_are_refused():
    head, teacher_head = torch.nn.Linear(D, V), torch.nn.Linear(TEACHER_D, V + 2)
    with pytest.raises(ValueError, match="same rows"):
        chunked_jsd(
            torch.randn(3, D),
            head,
            torch.zeros(3, dtype=torch.long),
            torch.randn(2, TEACHER_D),
            head,
            0.0,
        )
    with pytest.raises(ValueError, match="same vocabulary"):
        chunked_jsd(
            torch.randn(3, D),
            head,
            torch.zeros(3, dtype=torch.long),
            torch.randn(3, TEACHER_D),
            teacher_head,
            0.0,
        )


@pytest.mark.parametrize("beta", [0.0, 0.4, 1.0])
@pytest.mark.parametrize("chunk_size", [1, 3, 100])
def test_several_teacher_heads_read_as_their_weighted_sum_per_row(beta, chunk_size):
    """Rows 0-3 a mixture (0.3 / 0.7), rows 4-7 the first teacher's alone, rows 8-10 the second's
    (weights 1 / 0, as rows of two datasets with their own teachers): the loss and the gradients
    equal autograd through the naive JSD against ``log(sum_i w_i softmax_i)``, chunks crossing
    the kinds of rows."""
    torch.manual_seed(5)
    hidden = torch.randn(N, D, requires_grad=True)
    head = torch.nn.Linear(D, PADDED_V, bias=True)
    first_hidden, second_hidden = torch.randn(N, TEACHER_D) * 2, torch.randn(N, D) * 2
    first_head = torch.nn.Linear(TEACHER_D, PADDED_V, bias=False)
    second_head = torch.nn.Linear(D, PADDED_V, bias=True)
    first_weight = torch.tensor([0.3] * 4 + [1.0] * 4 + [0.0] * 3)
    second_transform = LogitTransform(temperature=0.8)
    ids = torch.randint(0, V, (N,))
    upstream = torch.randn(N)
    teachers = [
        HeadRows(first_hidden, first_head, LogitTransform(), first_weight),
        HeadRows(second_hidden, second_head, second_transform, 1.0 - first_weight),
    ]
    loss, _, _ = chunked_jsd_mixed(
        hidden, head, ids, teachers, beta, chunk_size=chunk_size, vocab_size=V
    )
    (loss * upstream).sum().backward()
    fused_grads = [hidden.grad.clone(), head.weight.grad.clone(), head.bias.grad.clone()]
    hidden.grad = None
    head.zero_grad()

    student_log = torch.log_softmax((hidden @ head.weight[:V].T) + head.bias[:V], -1)
    with torch.no_grad():
        first = torch.softmax(first_hidden @ first_head.weight[:V].T, -1)
        second = torch.softmax(
            (second_hidden @ second_head.weight[:V].T + second_head.bias[:V]) / 0.8, -1
        )
        teacher_log = (first_weight[:, None] * first + (1 - first_weight[:, None]) * second).log()
    reference = generalized_jsd(student_log, teacher_log, beta)
    (reference * upstream).sum().backward()
    torch.testing.assert_close(loss, reference, atol=1e-5, rtol=1e-5)
    for fused, expected in zip(
        fused_grads, [hidden.grad, head.weight.grad, head.bias.grad], strict=True
    ):
        torch.testing.assert_close(fused, expected, atol=1e-5, rtol=1e-5)


def test_one_teacher_head_with_every_weight_1_is_the_plain_kernel_bit_for_bit():
    torch.manual_seed(6)
    hidden = torch.randn(N, D, requires_grad=True)
    head = torch.nn.Linear(D, V)
    teacher_hidden, teacher_head = torch.randn(N, TEACHER_D), torch.nn.Linear(TEACHER_D, V)
    ids = torch.randint(0, V, (N,))
    plain = chunked_jsd(hidden, head, ids, teacher_hidden, teacher_head, 0.5, chunk_size=4)
    (plain_grad,) = torch.autograd.grad(plain[0].sum(), hidden)
    rows = HeadRows(teacher_hidden, teacher_head, LogitTransform(), torch.ones(N))
    weighted = chunked_jsd_mixed(hidden, head, ids, [rows], 0.5, chunk_size=4)
    (weighted_grad,) = torch.autograd.grad(weighted[0].sum(), hidden)
    assert torch.equal(plain[0], weighted[0]) and torch.equal(plain_grad, weighted_grad)
