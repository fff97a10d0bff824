"""Chunked log-probs and their gradients against the naive full-logits computation."""

import pytest
import torch

from opd.logprobs import (
    HeadGradients,
    LogitTransform,
    logit_transform_for,
    selected_token_logprobs,
    sequence_logprobs,
)
from tests.conftest import tiny_llama


def naive(hidden, weight, bias, ids, transform: LogitTransform, vocab_size=None):
    if vocab_size is not None:
        weight = weight[:vocab_size]
        bias = bias[:vocab_size] if bias is not None else None
    raw = hidden @ weight.T + (bias if bias is not None else 0)
    z = raw * transform.scale
    if transform.softcap is not None:
        z = transform.softcap * torch.tanh(z / transform.softcap)
    z = z / transform.temperature
    logp = torch.log_softmax(z, -1)
    entropy = -(logp.exp() * logp).sum(-1)
    return logp.gather(-1, ids[:, None]).squeeze(-1), entropy


@pytest.mark.parametrize("chunk_size", [1, 3, 7, 50])
@pytest.mark.parametrize(
    "transform",
    [
        LogitTransform(),
        LogitTransform(scale=0.5, softcap=3.0, temperature=0.7),
        LogitTransform(temperature=1.3),
    ],
)
@pytest.mark.parametrize("with_bias", [False, True])
def test_values_and_gradients_match_naive(chunk_size, transform, with_bias):
    torch.manual_seed(0)
    n, d, v = 13, 8, 29
    hidden = torch.randn(n, d, requires_grad=True)
    head = torch.nn.Linear(d, v, bias=with_bias)
    ids = torch.randint(0, v, (n,))
    upstream = torch.randn(n)

    logp, entropy = selected_token_logprobs(
        hidden, head, ids, chunk_size=chunk_size, transform=transform
    )
    (logp * upstream).sum().backward()
    grads = (
        hidden.grad.clone(),
        head.weight.grad.clone(),
        head.bias.grad.clone() if with_bias else None,
    )

    hidden.grad = None
    head.zero_grad()
    ref_logp, ref_entropy = naive(hidden, head.weight, head.bias, ids, transform)
    (ref_logp * upstream).sum().backward()

    torch.testing.assert_close(logp, ref_logp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(entropy, ref_entropy.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grads[0], hidden.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grads[1], head.weight.grad, atol=1e-5, rtol=1e-5)
    if with_bias:
        torch.testing.assert_close(grads[2], head.bias.grad, atol=1e-5, rtol=1e-5)


def test_without_entropy_gives_the_same_logprobs_and_gradients():
    torch.manual_seed(2)
    hidden = torch.randn(11, 8, requires_grad=True)
    head = torch.nn.Linear(8, 23, bias=False)
    ids = torch.randint(0, 23, (11,))
    with_entropy, entropy = selected_token_logprobs(hidden, head, ids, chunk_size=4)
    without, zeros = selected_token_logprobs(hidden, head, ids, chunk_size=4, with_entropy=False)
    torch.testing.assert_close(with_entropy, without)
    assert torch.all(zeros == 0) and torch.all(entropy > 0)
    ref, _ = naive(hidden, head.weight, None, ids, LogitTransform())
    (grad_chunked,) = torch.autograd.grad(without.sum(), hidden)
    (grad_naive,) = torch.autograd.grad(ref.sum(), hidden)
    torch.testing.assert_close(grad_chunked, grad_naive, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("with_entropy", [True, False])
@pytest.mark.parametrize(
    ("chunk_size", "transform", "recomputed"),
    [
        (50, LogitTransform(temperature=0.7), 0),
        (4, LogitTransform(), 3),
        (4, LogitTransform(softcap=3.0), 4),
    ],
)
def test_only_earlier_chunks_are_recomputed_and_a_second_backward_recomputes_all(
    monkeypatch, with_entropy, chunk_size, transform, recomputed
):
    torch.manual_seed(4)
    n = 13
    hidden = torch.randn(n, 8, requires_grad=True)
    head = torch.nn.Linear(8, 23)
    ids = torch.randint(0, 23, (n,))
    calls, added = [], []
    rebuild, add = HeadGradients.logits, HeadGradients.add
    monkeypatch.setattr(
        HeadGradients, "logits", lambda self, *a: calls.append(a) or rebuild(self, *a)
    )
    monkeypatch.setattr(HeadGradients, "add", lambda self, *a: added.append(a[0]) or add(self, *a))
    logp, _ = selected_token_logprobs(
        hidden, head, ids, chunk_size=chunk_size, transform=transform, with_entropy=with_entropy
    )
    logp.sum().backward(retain_graph=True)
    assert len(calls) == recomputed
    starts = list(range(0, n, chunk_size))
    kept_first = recomputed < len(starts)  # the kept chunk's buffer is freed before any rebuild
    assert added == (starts[-1:] + starts[:-1] if kept_first else starts)
    logp.sum().backward()
    assert len(calls) == recomputed + -(-n // chunk_size)
    twice = (hidden.grad.clone(), head.weight.grad.clone(), head.bias.grad.clone())
    hidden.grad = None
    head.zero_grad()
    ref, _ = naive(hidden, head.weight, head.bias, ids, transform)
    ref.sum().backward()
    for got, once in zip(twice, (hidden.grad, head.weight.grad, head.bias.grad), strict=True):
        torch.testing.assert_close(got, 2 * once, atol=1e-5, rtol=1e-5)


def test_vocab_slice_normalises_over_tokenizer_rows_only():
    torch.manual_seed(1)
    hidden = torch.randn(5, 4)
    head = torch.nn.Linear(4, 12, bias=False)
    ids = torch.tensor([0, 3, 9, 9, 1])
    logp, _ = selected_token_logprobs(hidden, head, ids, chunk_size=2, vocab_size=10)
    ref, _ = naive(hidden, head.weight, None, ids, LogitTransform(), vocab_size=10)
    torch.testing.assert_close(logp, ref, atol=1e-6, rtol=1e-6)
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        selected_token_logprobs(hidden, head, torch.tensor([0, 0, 0, 0, 11]), vocab_size=10)


def test_shape_errors_name_both_shapes():
    head = torch.nn.Linear(4, 6)
    with pytest.raises(ValueError, match=r"\(3, 4\).*\(2,\)"):
        selected_token_logprobs(torch.zeros(3, 4), head, torch.zeros(2, dtype=torch.long))


@pytest.mark.parametrize("tie", [True, False])
def test_sequence_logprobs_with_padding_match_model_logits(tie):
    """Right-padded batch, tied or untied embeddings: values and parameter gradients equal the naive
    path."""
    model = tiny_llama(40, tie=tie, seed=3).train()
    ids = torch.tensor([[5, 6, 7, 8, 9, 10], [11, 12, 13, 0, 0, 0]])
    attention = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0]])
    score = torch.tensor([[0, 0, 1, 1, 1, 1], [0, 1, 1, 0, 0, 0]])

    logp, _ = sequence_logprobs(model, ids, attention, score, chunk_size=3)
    logp.sum().backward()
    chunked_grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()

    logits = model(input_ids=ids, attention_mask=attention).logits[:, :-1].float()
    ref = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1) * score[:, 1:]
    ref.sum().backward()
    torch.testing.assert_close(logp[:, 1:], ref, atol=1e-5, rtol=1e-5)
    assert torch.all(logp[score == 0] == 0)
    for name, p in model.named_parameters():
        torch.testing.assert_close(chunked_grads[name], p.grad, atol=1e-5, rtol=1e-4, msg=name)


def test_logit_transform_reads_model_config():
    model = tiny_llama(20, seed=0)
    model.config.final_logit_softcapping = 30.0
    model.config.logit_scale = 0.25
    transform = logit_transform_for(model, temperature=2.0)
    assert transform == LogitTransform(scale=0.25, softcap=30.0, temperature=2.0)


def test_autocast_runs_the_body_in_bfloat16_and_the_head_in_float32():
    model = tiny_llama(40, seed=3).train()
    ids = torch.tensor([[5, 6, 7, 8, 9, 10], [11, 12, 13, 0, 0, 0]])
    attention = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0]])
    score = torch.tensor([[0, 0, 1, 1, 1, 1], [0, 1, 1, 0, 0, 0]])
    body_linears = [m for m in model.model.modules() if isinstance(m, torch.nn.Linear)]
    output_dtypes = []

    def record(_module, _inputs, output):
        output_dtypes.append(output.dtype)

    hooks = [m.register_forward_hook(record) for m in body_linears]
    logp, _ = sequence_logprobs(model, ids, attention, score, autocast_dtype=torch.bfloat16)
    for hook in hooks:
        hook.remove()
    assert len(output_dtypes) == len(body_linears) and set(output_dtypes) == {torch.bfloat16}

    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        hidden = model.model(input_ids=ids, attention_mask=attention).last_hidden_state
    logits = hidden[:, :-1].double() @ model.lm_head.weight.double().T
    ref = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1) * score[:, 1:]
    assert logp.dtype == torch.float32
    torch.testing.assert_close(logp[:, 1:].double(), ref, atol=1e-5, rtol=0)

    full_precision, _ = sequence_logprobs(model, ids, attention, score)
    gap = (logp - full_precision.detach())[score.bool()].abs()
    assert 1e-4 < gap.max() < 0.1, gap
    logp.sum().backward()
    assert all(
        p.grad.dtype == torch.float32 and p.grad.isfinite().all() for p in model.parameters()
    )
