"""The chunked lm-head autograd scaffold: a head applied a chunk of rows at a time, its backward
recomputing each chunk's logits instead of keeping them (one ``chunk x V`` buffer alive at a
time). :class:`HeadGradients` is shared by every fused head (the selected-token log-probs here,
``jsd`` and ``topk_forward_kl`` in :mod:`opd.objectives`)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from torch import nn

from opd.logprobs.transform import (
    PLAIN_LOGITS,
    LogitTransform,
    chunk_logits,
    chunk_logits_inplace,
    head_weights,
    refuse_ids_outside,
    row_dot,
)


def head_gradient_expected(hidden_ND: torch.Tensor, lm_head: nn.Module) -> bool:
    """Whether autograd will differentiate through the head now (forward then keeps a gradient)."""
    if not torch.is_grad_enabled():
        return False
    return hidden_ND.requires_grad or any(p.requires_grad for p in lm_head.parameters())


def backward_chunk_starts(rows: int, chunk_size: int, last_kept: bool) -> list[int]:
    """The chunks' first rows in the order backward visits them.

    A chunk whose gradient forward kept goes first, so its buffer is freed before any other
    chunk's logits are rebuilt (one ``chunk x V`` buffer alive at a time, as without it).
    """
    starts = list(range(0, rows, chunk_size))
    return starts[-1:] + starts[:-1] if last_kept else starts


def check_head_rows(hidden_ND: torch.Tensor, token_ids_N: torch.Tensor, chunk_size: int) -> None:
    """What every head checks before its first chunk: at least one row a chunk, ``(N, D)`` hidden
    states and one scored token id per row (a clear error, not a shape error inside a gather)."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if hidden_ND.dim() != 2 or token_ids_N.dim() != 1 or hidden_ND.shape[0] != token_ids_N.shape[0]:
        raise ValueError(
            f"hidden states must be (N, D) and token ids (N,); got {tuple(hidden_ND.shape)} and "
            f"{tuple(token_ids_N.shape)}"
        )


def logit_chunks(
    hidden_ND: torch.Tensor,
    weight_VD: torch.Tensor,
    bias_V: torch.Tensor | None,
    transform: LogitTransform,
    chunk_size: int,
) -> Iterator[tuple[int, int, torch.Tensor]]:
    """The forward loop every head shares: each chunk's rows ``start:end`` and its transformed
    float32 logits, in a fresh buffer the head may overwrite. One ``chunk x V`` buffer is alive
    at a time as long as the head drops its names for a chunk's buffers before the next."""
    for start in range(0, hidden_ND.shape[0], chunk_size):
        end = start + chunk_size
        yield start, end, chunk_logits_inplace(hidden_ND[start:end], weight_VD, bias_V, transform)


class _SelectedTokenLogProbs(torch.autograd.Function):
    """log softmax(z)[token] and the entropy of softmax(z), chunk by chunk, recomputed in backward.

    Every V-wide step works in place, so a chunk needs one float32 ``chunk x V`` buffer (two
    when the entropy is asked for), and backward redoes one matmul per chunk instead of
    keeping the logits, except for the last chunk: when a gradient will be asked for, forward
    keeps that chunk's probabilities (already in one of its buffers), so with a single chunk
    backward recomputes nothing.
    """

    @staticmethod
    def forward(
        ctx,
        hidden_ND,
        weight_VD,
        bias_V,
        token_ids_N,
        chunk_size,
        transform,
        with_entropy,
        keep_last,
    ):
        rows = hidden_ND.shape[0]
        logprobs_N = hidden_ND.new_empty(rows, dtype=torch.float32)
        entropy_N = torch.zeros_like(logprobs_N)
        logsumexp_N = torch.empty_like(logprobs_N)
        ctx.kept_probs = None
        for start, end, shifted in logit_chunks(
            hidden_ND, weight_VD, bias_V, transform, chunk_size
        ):
            row_max = shifted.amax(dim=-1)
            selected = shifted.gather(-1, token_ids_N[start:end, None]).squeeze(-1)
            shifted -= row_max[:, None]
            if with_entropy:
                exps = torch.exp(shifted)
                total = exps.sum(-1)
                weighted = row_dot(exps, shifted)
                entropy_N[start:end] = torch.log(total) - weighted / total
            else:
                exps = shifted.exp_()
                total = exps.sum(-1)
            if keep_last and end >= rows and transform.softcap is None:
                ctx.kept_probs = exps.div_(total[:, None])
            lse = row_max + torch.log(total)
            logprobs_N[start:end] = selected - lse
            logsumexp_N[start:end] = lse
            del shifted, exps
        ctx.save_for_backward(hidden_ND, weight_VD, bias_V, token_ids_N, logsumexp_N)
        ctx.chunk_size = chunk_size
        ctx.transform = transform
        ctx.mark_non_differentiable(entropy_N)
        return logprobs_N, entropy_N

    @staticmethod
    def backward(ctx, grad_logprobs_N, _grad_entropy_N):
        hidden_ND, weight_VD, bias_V, token_ids_N, logsumexp_N = ctx.saved_tensors
        grads = HeadGradients(hidden_ND, weight_VD, bias_V, ctx.needs_input_grad[:3], ctx.transform)
        kept_probs, ctx.kept_probs = ctx.kept_probs, None  # used once: a second backward recomputes

        def minus_one_hot_(probs: torch.Tensor, start: int) -> torch.Tensor:
            """``p - onehot(token)`` in place: d (-log p[token]) / d logits."""
            rows = torch.arange(probs.shape[0], device=probs.device)
            probs[rows, token_ids_N[start : start + probs.shape[0]]] -= 1.0
            return probs

        def recompute(start: int, end: int) -> tuple[torch.Tensor, float, torch.Tensor | None]:
            logits, derivative = grads.logits(start, end)
            logits -= logsumexp_N[start:end, None]
            return minus_one_hot_(logits.exp_(), start), -1.0, derivative

        kept = None
        if kept_probs is not None:
            last = (hidden_ND.shape[0] - 1) // ctx.chunk_size * ctx.chunk_size
            kept = (minus_one_hot_(kept_probs, last), -1.0)
        gradients = grads.chunked_backward(grad_logprobs_N, ctx.chunk_size, kept, recompute)
        return (*gradients, None, None, None, None, None)


class HeadGradients:
    """Gradients of ``transform(hidden @ weight.T + bias)`` accumulated chunk by chunk.

    Shared by the fused head Functions: each recomputes a chunk's logits with :meth:`logits`,
    turns them in place into d loss / d logits, and hands them to :meth:`add`, which chains
    through the transform and the matmul. A constant transform factor is left to the caller
    (``constant_factor``: folding it into a per-row scale saves a pass over the chunk).
    """

    def __init__(self, hidden_ND, weight_VD, bias_V, needs_grad, transform: LogitTransform):
        need_hidden, need_weight, need_bias = needs_grad
        self.hidden_ND, self.weight_VD, self.bias_V, self.transform = (
            hidden_ND,
            weight_VD,
            bias_V,
            transform,
        )
        self.grad_hidden = torch.zeros_like(hidden_ND) if need_hidden else None
        self.grad_weight = torch.zeros_like(weight_VD, dtype=torch.float32) if need_weight else None
        self.grad_bias = torch.zeros_like(bias_V, dtype=torch.float32) if need_bias else None
        self.constant_factor = (
            transform.scale / transform.temperature if transform.softcap is None else 1.0
        )

    def logits(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The chunk's float32 logits (a fresh buffer to overwrite) and, with a softcap, dz/draw."""
        hidden_chunk = self.hidden_ND[start:end]
        if self.transform.softcap is None:
            return chunk_logits_inplace(
                hidden_chunk, self.weight_VD, self.bias_V, self.transform
            ), None
        return chunk_logits(hidden_chunk, self.weight_VD, self.bias_V, self.transform)

    def add(
        self, start: int, end: int, grad_logits: torch.Tensor, derivative: torch.Tensor | None
    ) -> None:
        """Chain d loss / d logits of rows ``start:end`` into the hidden, weight and bias grads."""
        if derivative is not None:
            grad_logits *= derivative
        hidden_chunk = self.hidden_ND[start:end]
        if self.grad_hidden is not None:
            weight = self.weight_VD
            self.grad_hidden[start:end] = (grad_logits.to(weight.dtype) @ weight).to(
                hidden_chunk.dtype
            )
        if self.grad_weight is not None:
            self.grad_weight.addmm_(grad_logits.T, hidden_chunk.float())
        if self.grad_bias is not None:
            self.grad_bias += grad_logits.sum(0)

    def chunked_backward(
        self,
        grad_loss_N: torch.Tensor,
        chunk_size: int,
        kept: tuple[torch.Tensor, float] | None,
        recompute: Callable[[int, int], tuple[torch.Tensor, float, torch.Tensor | None]],
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """The backward of a per-row loss whose d loss_row / d logits is ``buffer * factor``: the
        last chunk's ``kept`` by forward, the others' from ``recompute(start, end)`` (which
        returns ``(buffer, factor, dz/draw)``), each scaled by the rows' incoming gradient and
        chained into the hidden, weight and bias gradients. The fused heads share this loop."""
        rows = self.hidden_ND.shape[0]
        for start in backward_chunk_starts(rows, chunk_size, kept is not None):
            end = start + chunk_size
            if kept is not None and end >= rows:
                (grad_logits, factor), derivative, kept = kept, None, None
            else:
                grad_logits, factor, derivative = recompute(start, end)
            grad_logits *= (grad_loss_N[start:end] * (self.constant_factor * factor))[:, None]
            self.add(start, end, grad_logits, derivative)
            del grad_logits
        return self.result()

    def result(self) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """``(grad_hidden, grad_weight, grad_bias)`` in their parameters' dtypes."""
        grad_weight = (
            None if self.grad_weight is None else self.grad_weight.to(self.weight_VD.dtype)
        )
        grad_bias = None if self.grad_bias is None else self.grad_bias.to(self.bias_V.dtype)
        return self.grad_hidden, grad_weight, grad_bias


def selected_token_logprobs(
    hidden_ND: torch.Tensor,
    lm_head: nn.Linear,
    token_ids_N: torch.Tensor,
    *,
    chunk_size: int = 1024,
    transform: LogitTransform = PLAIN_LOGITS,
    vocab_size: int | None = None,
    with_entropy: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probabilities of ``token_ids_N`` under ``lm_head(hidden_ND)``, and the entropies.

    Args:
        hidden_ND: final hidden states, one row per scored position (the position *before*
            the token it predicts).
        lm_head: the output projection (tied embeddings work: its weight is the embedding).
        token_ids_N: the token each row is scored on.
        chunk_size: rows whose logits exist at once; memory is ``chunk_size x V`` floats.
        transform: logit scaling, soft-capping and temperature.
        vocab_size: normalise over the first ``vocab_size`` rows only (an embedding padded
            beyond the tokenizer), so two models with padded vocabularies stay comparable.
        with_entropy: also compute each row's entropy (one more V-wide buffer and pass);
            zeros are returned when False.

    Returns:
        ``(logprobs_N, entropy_N)`` in float32; gradients flow into ``logprobs_N`` only.
    """
    check_head_rows(hidden_ND, token_ids_N, chunk_size)
    weight, bias = head_weights(lm_head, vocab_size)
    refuse_ids_outside(token_ids_N, weight.shape[0], "token id")
    keep_last = head_gradient_expected(hidden_ND, lm_head)
    return _SelectedTokenLogProbs.apply(
        hidden_ND, weight, bias, token_ids_N, chunk_size, transform, with_entropy, keep_last
    )
