"""Full-distribution divergences and their chunked computation, against independent references."""

import math

import pytest
import torch
import torch.nn.functional as F

from opd.logprobs import LogitTransform
from tests.reference import chunked_head_objective, generalized_jsd, topk_forward_kl

STUDENT = torch.log(torch.tensor([[0.1, 0.9]]))
TEACHER = torch.log(torch.tensor([[0.9, 0.1]]))


@pytest.mark.parametrize("beta", [0.0, 1.0])
def test_gkd_check_value(beta):
    """Student [.1, .9], teacher [.9, .1]: forward = reverse = 0.8 ln 9 (NOTES section 2)."""
    assert generalized_jsd(STUDENT, TEACHER, beta).item() == pytest.approx(
        0.8 * math.log(9), rel=1e-6
    )


def test_endpoints_equal_torch_kl_div():
    torch.manual_seed(0)
    student = torch.log_softmax(torch.randn(6, 11), -1)
    teacher = torch.log_softmax(torch.randn(6, 11), -1)
    forward = F.kl_div(student, teacher, log_target=True, reduction="none").sum(
        -1
    )  # KL(teacher || student)
    reverse = F.kl_div(teacher, student, log_target=True, reduction="none").sum(
        -1
    )  # KL(student || teacher)
    torch.testing.assert_close(generalized_jsd(student, teacher, 0.0), forward)
    torch.testing.assert_close(generalized_jsd(student, teacher, 1.0), reverse)


def test_interior_beta_matches_the_mixture_formula_by_hand():
    s, t = torch.tensor([0.1, 0.9]), torch.tensor([0.9, 0.1])
    beta = 0.3
    m = (1 - beta) * s + beta * t
    expected = beta * (t * (t / m).log()).sum() + (1 - beta) * (s * (s / m).log()).sum()
    assert generalized_jsd(s.log()[None], t.log()[None], beta).item() == pytest.approx(
        expected.item(), rel=1e-6
    )


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_identical_distributions_give_zero(beta):
    logp = torch.log_softmax(torch.randn(4, 9), -1)
    torch.testing.assert_close(
        generalized_jsd(logp, logp.clone(), beta), torch.zeros(4), atol=1e-6, rtol=0
    )
    top = logp.topk(3, -1)
    torch.testing.assert_close(
        topk_forward_kl(logp, top.indices, top.values), torch.zeros(4), atol=1e-6, rtol=0
    )


def test_topk_forward_kl_by_hand():
    student = torch.tensor([[0.5, 0.2, 0.2, 0.1]]).log()
    teacher = torch.tensor([[0.1, 0.6, 0.1, 0.2]])
    top = teacher.log().topk(2, -1)  # tokens 1 (0.6) and 3 (0.2); tail mass 0.2 vs student 0.7
    expected = 0.6 * math.log(0.6 / 0.2) + 0.2 * math.log(0.2 / 0.1) + 0.2 * math.log(0.2 / 0.7)
    assert topk_forward_kl(student, top.indices, top.values).item() == pytest.approx(
        expected, rel=1e-5
    )
    everything = teacher.log().topk(4, -1)
    full = F.kl_div(student, teacher.log(), log_target=True, reduction="sum")
    assert topk_forward_kl(student, everything.indices, everything.values).item() == pytest.approx(
        full.item(), abs=1e-6
    )


@pytest.mark.parametrize("chunk_size", [1, 4, 100])
@pytest.mark.parametrize("objective", ["jsd", "topk"])
def test_chunked_head_objective_matches_naive_values_and_gradients(chunk_size, objective):
    torch.manual_seed(1)
    n, d, v, k = 9, 6, 17, 5
    transform = LogitTransform(scale=0.7, temperature=0.9)
    hidden = torch.randn(n, d, requires_grad=True)
    head = torch.nn.Linear(d, v, bias=False)
    ids = torch.randint(0, v, (n,))
    teacher_log = torch.log_softmax(torch.randn(n, v) * 2, -1)
    top = teacher_log.topk(k, -1)

    def row_loss(student_log, rows):
        if objective == "jsd":
            return generalized_jsd(student_log, teacher_log[rows], 0.4)
        return topk_forward_kl(student_log, top.indices[rows], top.values[rows])

    loss, selected, entropy = chunked_head_objective(
        hidden, head, ids, row_loss, chunk_size=chunk_size, transform=transform
    )
    upstream = torch.randn(n)
    (loss * upstream).sum().backward()
    grads = hidden.grad.clone(), head.weight.grad.clone()
    hidden.grad = None
    head.zero_grad()

    student_log = torch.log_softmax((hidden @ head.weight.T) * 0.7 / 0.9, -1)
    reference = row_loss(student_log, slice(0, n))
    (reference * upstream).sum().backward()
    torch.testing.assert_close(loss, reference, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(selected, student_log.gather(-1, ids[:, None]).squeeze(-1).detach())
    torch.testing.assert_close(entropy, -(student_log.exp() * student_log).sum(-1).detach())
    torch.testing.assert_close(grads[0], hidden.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grads[1], head.weight.grad, atol=1e-5, rtol=1e-5)
