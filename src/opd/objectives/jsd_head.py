"""The generalized JSD between student and teacher heads, fused and chunked, with an analytic gradient.

For student logits ``z`` with ``S = softmax(z)``, teacher ``T`` and ``M = (1 - beta) S + beta T``
(GKD's generalized JSD, ``beta KL(T || M) + (1 - beta) KL(S || M)``), the gradient with respect to ``z`` is

- ``beta = 0``, ``KL(T || S)``: ``S - T``;
- ``beta = 1``, ``KL(S || T)``: ``S * (log S - log T - KL(S || T))``;
- otherwise: ``(1 - beta) S * (log S - log M - KL(S || M))`` (``d JSD / d S = (1 - beta) log(S / M)``,
  then through the softmax).

Autograd through the same computation keeps about ten ``chunk x V`` tensors per chunk and
checkpointing recomputes them all before differentiating; here a chunk needs three float32
``chunk x V`` buffers at most for beta 0 or 1 (six for an interior beta), worked in place.
Backward recomputes both heads' logits instead of keeping them, except for the last chunk,
whose gradient forward leaves in one of its buffers (with a single chunk, nothing is redone).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from opd.logprobs import (
    PLAIN_LOGITS,
    HeadGradients,
    LogitTransform,
    chunk_logits_inplace,
    head_gradient_expected,
    head_weights,
    row_dot,
)


def _log_softmax_(logits: torch.Tensor) -> torch.Tensor:
    """Turn a chunk of logits into log-probs in place; return each row's logsumexp."""
    logsumexp = torch.logsumexp(logits, dim=-1)
    logits -= logsumexp[:, None]
    return logsumexp


def _mixture_log_(student_log: torch.Tensor, teacher_log: torch.Tensor, beta: float) -> torch.Tensor:
    """log M = logaddexp(log S + log(1 - beta), log T + log beta), overwriting ``teacher_log``."""
    teacher_log += math.log(beta)
    return torch.logaddexp(student_log + math.log(1.0 - beta), teacher_log, out=teacher_log)


class _ChunkedJSD(torch.autograd.Function):
    """Per-row generalized JSD, the student's log-prob of each token and its entropy, chunk by chunk.

    When a gradient will be asked for, forward keeps the last chunk's gradient (its buffers
    exist anyway), so backward recomputes the other chunks only.
    """

    @staticmethod
    def forward(
        ctx,
        hidden_ND,
        weight_VD,
        bias_V,
        teacher_hidden_ND,
        teacher_weight_VD,
        teacher_bias_V,
        token_ids_N,
        beta,
        chunk_size,
        transform,
        teacher_transform,
        keep_last,
    ):
        rows = hidden_ND.shape[0]
        loss_N = hidden_ND.new_empty(rows, dtype=torch.float32)
        selected_N, entropy_N = torch.empty_like(loss_N), torch.empty_like(loss_N)
        student_lse_N, teacher_lse_N = torch.empty_like(loss_N), torch.empty_like(loss_N)
        student_mixture_kl_N = torch.empty_like(loss_N)
        ctx.kept = None
        for start in range(0, rows, chunk_size):
            end = start + chunk_size
            student_log = chunk_logits_inplace(hidden_ND[start:end], weight_VD, bias_V, transform)
            student_lse_N[start:end] = _log_softmax_(student_log)
            selected_N[start:end] = student_log.gather(-1, token_ids_N[start:end, None]).squeeze(-1)
            student_prob = student_log.exp()
            entropy_N[start:end] = -row_dot(student_prob, student_log)
            teacher_log = chunk_logits_inplace(
                teacher_hidden_ND[start:end], teacher_weight_VD, teacher_bias_V, teacher_transform
            )
            teacher_lse_N[start:end] = _log_softmax_(teacher_log)
            keep = keep_last and end >= rows and transform.softcap is None
            if beta == 0.0:
                teacher_prob = torch.exp(teacher_log, out=student_prob)
                teacher_log -= student_log
                loss_N[start:end] = row_dot(teacher_prob, teacher_log)
                if keep:  # S - T
                    ctx.kept = (student_log.exp_().sub_(teacher_prob), 1.0)
            elif beta == 1.0:
                torch.sub(student_log, teacher_log, out=teacher_log)
                loss_N[start:end] = row_dot(student_prob, teacher_log)
                if keep:  # S (log S - log T - KL(S || T))
                    teacher_log -= loss_N[start:end, None]
                    ctx.kept = (teacher_log.mul_(student_prob), 1.0)
            else:
                teacher_prob = teacher_log.exp()
                mixture_log = _mixture_log_(student_log, teacher_log.clone(), beta)
                teacher_log -= mixture_log
                student_log -= mixture_log
                student_mixture_kl = row_dot(student_prob, student_log)
                student_mixture_kl_N[start:end] = student_mixture_kl
                loss_N[start:end] = (
                    beta * row_dot(teacher_prob, teacher_log) + (1.0 - beta) * student_mixture_kl
                )
                if keep:  # (1 - beta) S (log S - log M - KL(S || M))
                    student_log -= student_mixture_kl[:, None]
                    ctx.kept = (student_log.mul_(student_prob), 1.0 - beta)
            del student_log, student_prob, teacher_log
        divergence_N = student_mixture_kl_N if 0.0 < beta < 1.0 else loss_N
        ctx.save_for_backward(
            hidden_ND,
            weight_VD,
            bias_V,
            teacher_hidden_ND,
            teacher_weight_VD,
            teacher_bias_V,
            student_lse_N,
            teacher_lse_N,
            divergence_N,
        )
        ctx.beta, ctx.chunk_size = beta, chunk_size
        ctx.transform, ctx.teacher_transform = transform, teacher_transform
        ctx.mark_non_differentiable(selected_N, entropy_N)
        return loss_N, selected_N, entropy_N

    @staticmethod
    def backward(ctx, grad_loss_N, _grad_selected_N, _grad_entropy_N):
        hidden_ND, weight_VD, bias_V, *teacher_side = ctx.saved_tensors
        grads = HeadGradients(hidden_ND, weight_VD, bias_V, ctx.needs_input_grad[:3], ctx.transform)
        kept, ctx.kept = ctx.kept, None  # used once: a second backward recomputes
        gradients = grads.chunked_backward(
            grad_loss_N,
            ctx.chunk_size,
            kept,
            lambda start, end: _recomputed_gradient(ctx, grads, start, end, teacher_side),
        )
        return (*gradients, *[None] * 9)


def _recomputed_gradient(ctx, grads: HeadGradients, start: int, end: int, teacher_side: list):
    """d JSD / d z of rows ``start:end`` from both heads' logits again: ``(buffer, factor, dz/draw)``.

    The gradient is ``buffer * factor``: the sign and ``1 - beta`` go into the row scale.
    """
    teacher_hidden_ND, teacher_weight_VD, teacher_bias_V, student_lse_N, teacher_lse_N, divergence_N = (
        teacher_side
    )
    student_log, derivative = grads.logits(start, end)
    student_log -= student_lse_N[start:end, None]
    teacher_log = chunk_logits_inplace(
        teacher_hidden_ND[start:end], teacher_weight_VD, teacher_bias_V, ctx.teacher_transform
    )
    teacher_log -= teacher_lse_N[start:end, None]
    if ctx.beta == 0.0:
        student_log.exp_()
        student_log -= teacher_log.exp_()
        return student_log, 1.0, derivative
    reference_log = teacher_log if ctx.beta == 1.0 else _mixture_log_(student_log, teacher_log, ctx.beta)
    reference_log -= student_log
    reference_log += divergence_N[start:end, None]
    student_log.exp_()
    student_log *= reference_log
    return student_log, -(1.0 if ctx.beta == 1.0 else 1.0 - ctx.beta), derivative


def chunked_jsd(
    hidden_ND: torch.Tensor,
    lm_head: nn.Linear,
    token_ids_N: torch.Tensor,
    teacher_hidden_ND: torch.Tensor,
    teacher_head: nn.Linear,
    beta: float,
    *,
    chunk_size: int = 1024,
    transform: LogitTransform = PLAIN_LOGITS,
    teacher_transform: LogitTransform = PLAIN_LOGITS,
    vocab_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Generalized JSD(beta) per row between ``lm_head(hidden_ND)`` and ``teacher_head(teacher_hidden_ND)``.

    Args:
        hidden_ND: the student's final hidden states, one row per scored position.
        lm_head: the student's output projection; gradients reach it and ``hidden_ND``.
        token_ids_N: the token each row predicts (for the returned log-probs).
        teacher_hidden_ND: the teacher's hidden states for the same rows (any dtype; no gradient).
        teacher_head: the teacher's output projection.
        beta: 0 is forward ``KL(T || S)``, 1 reverse ``KL(S || T)``, in between GKD's mixture JSD.
        chunk_size: rows whose logits exist at once (two or three ``chunk_size x V`` float32 buffers).
        transform / teacher_transform: each model's logit scaling and temperature.
        vocab_size: compare the first ``vocab_size`` logits only (embeddings padded beyond the tokenizer).

    Returns:
        ``(loss_N, logprobs_N, entropy_N)`` in float32; gradients flow into ``loss_N`` only.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must be in [0, 1], got {beta}")
    if teacher_hidden_ND.shape[0] != hidden_ND.shape[0]:
        raise ValueError(
            "student and teacher must score the same rows; "
            f"got {hidden_ND.shape[0]} and {teacher_hidden_ND.shape[0]}"
        )
    weight, bias = head_weights(lm_head, vocab_size)
    teacher_weight, teacher_bias = head_weights(teacher_head, vocab_size)
    if teacher_weight.shape[0] != weight.shape[0]:
        raise ValueError(
            f"student and teacher heads must cover the same vocabulary; got {weight.shape[0]} and "
            f"{teacher_weight.shape[0]} rows (set vocab_size to the tokenizer's)"
        )
    return _ChunkedJSD.apply(
        hidden_ND,
        weight,
        bias,
        teacher_hidden_ND.detach(),
        teacher_weight.detach(),
        None if teacher_bias is None else teacher_bias.detach(),
        token_ids_N,
        float(beta),
        chunk_size,
        transform,
        teacher_transform,
        head_gradient_expected(hidden_ND, lm_head),
    )
