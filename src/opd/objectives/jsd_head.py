"""The generalized JSD between student and teacher heads, fused and chunked, with an analytic
gradient.

For student logits ``z`` with ``S = softmax(z)``, teacher ``T`` and ``M = (1 - beta) S + beta T``
(GKD's generalized JSD, ``beta KL(T || M) + (1 - beta) KL(S || M)``), the gradient with respect to
``z`` is

- ``beta = 0``, ``KL(T || S)``: ``S - T``;
- ``beta = 1``, ``KL(S || T)``: ``S * (log S - log T - KL(S || T))``;
- otherwise: ``(1 - beta) S * (log S - log M - KL(S || M))`` (``d JSD / d S = (1 - beta) log(S /
M)``,
  then through the softmax).

Autograd through the same computation keeps about ten ``chunk x V`` tensors per chunk and
checkpointing recomputes them all before differentiating; here a chunk needs three float32
``chunk x V`` buffers at most for beta 0 or 1 (six for an interior beta), worked in place.
Backward recomputes both heads' logits instead of keeping them, except for the last chunk,
whose gradient forward leaves in one of its buffers (with a single chunk, nothing is redone).

The teacher side may be several teachers' heads, each with a weight per row: ``T`` is then
``sum_i w_i T_i`` (a mixture; or rows of different teachers, each row's own at weight 1), read
as ``logsumexp_i(log w_i + log T_i)`` chunk by chunk; a chunk whose rows one teacher scores
alone reads it as one teacher does, bit for bit.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from opd.logprobs import (
    PLAIN_LOGITS,
    HeadGradients,
    LogitTransform,
    check_head_rows,
    chunk_logits_inplace,
    head_gradient_expected,
    head_weights,
    logit_chunks,
    row_dot,
)
from opd.teachers.base import HeadRows


def _log_softmax_(logits: torch.Tensor) -> torch.Tensor:
    """Turn a chunk of logits into log-probs in place; return each row's logsumexp."""
    logsumexp = torch.logsumexp(logits, dim=-1)
    logits -= logsumexp[:, None]
    return logsumexp


def _mixture_log_(
    student_log: torch.Tensor, teacher_log: torch.Tensor, beta: float
) -> torch.Tensor:
    """log M = logaddexp(log S + log(1 - beta), log T + log beta), overwriting ``teacher_log``."""
    teacher_log += math.log(beta)
    return torch.logaddexp(student_log + math.log(1.0 - beta), teacher_log, out=teacher_log)


@dataclass
class _Head:
    """One teacher's head as the kernel reads it: weights cut to the vocabulary, detached."""

    hidden_ND: torch.Tensor
    weight_VD: torch.Tensor
    bias_V: torch.Tensor | None
    transform: LogitTransform
    log_weight_N: torch.Tensor | None
    """Each row's log weight of this head (None: 0, the head alone on every row)."""
    lse_N: torch.Tensor | None = None


class _TeacherHeads:
    """The teacher distribution of each row from one or several heads, chunk by chunk: forward
    keeps each head's logsumexp so that backward recomputes log-probs without another reduction."""

    def __init__(self, heads: list[_Head]):
        self.heads = heads
        rows = heads[0].hidden_ND.shape[0]
        for head in heads:
            head.lse_N = torch.empty(rows, dtype=torch.float32, device=head.hidden_ND.device)

    def _active(self, start: int, end: int) -> list[_Head]:
        """The heads with weight on some row of the chunk."""
        return [
            h
            for h in self.heads
            if h.log_weight_N is None or bool((h.log_weight_N[start:end] > -math.inf).any())
        ]

    def log_probs(self, start: int, end: int, again: bool = False) -> torch.Tensor:
        """``log T`` of rows ``start:end`` in a fresh float32 ``chunk x V`` buffer; ``again``: with
        the logsumexps forward kept."""
        mixed = None
        active = self._active(start, end)
        alone = len(active) == 1 and (
            active[0].log_weight_N is None or bool((active[0].log_weight_N[start:end] == 0).all())
        )
        for head in active:
            log = chunk_logits_inplace(
                head.hidden_ND[start:end], head.weight_VD, head.bias_V, head.transform
            )
            if again:
                log -= head.lse_N[start:end, None]
            else:
                head.lse_N[start:end] = _log_softmax_(log)
            if alone:
                return log
            log += head.log_weight_N[start:end, None]
            mixed = log if mixed is None else torch.logaddexp(mixed, log, out=mixed)
        return mixed


class _ChunkedJSD(torch.autograd.Function):
    """Per-row generalized JSD, the student's log-prob of each token and its entropy, chunk by
    chunk.

    When a gradient will be asked for, forward keeps the last chunk's gradient (its buffers
    exist anyway), so backward recomputes the other chunks only.
    """

    @staticmethod
    def forward(
        ctx,
        hidden_ND,
        weight_VD,
        bias_V,
        teachers,
        token_ids_N,
        beta,
        chunk_size,
        transform,
        keep_last,
    ):
        rows = hidden_ND.shape[0]
        loss_N = hidden_ND.new_empty(rows, dtype=torch.float32)
        selected_N, entropy_N = torch.empty_like(loss_N), torch.empty_like(loss_N)
        student_lse_N = torch.empty_like(loss_N)
        student_mixture_kl_N = torch.empty_like(loss_N)
        ctx.kept = None
        for start, end, student_log in logit_chunks(
            hidden_ND, weight_VD, bias_V, transform, chunk_size
        ):
            student_lse_N[start:end] = _log_softmax_(student_log)
            selected_N[start:end] = student_log.gather(-1, token_ids_N[start:end, None]).squeeze(-1)
            student_prob = student_log.exp()
            entropy_N[start:end] = -row_dot(student_prob, student_log)
            teacher_log = teachers.log_probs(start, end)
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
        ctx.save_for_backward(hidden_ND, weight_VD, bias_V, student_lse_N, divergence_N)
        ctx.beta, ctx.chunk_size, ctx.transform, ctx.teachers = (
            beta,
            chunk_size,
            transform,
            teachers,
        )
        ctx.mark_non_differentiable(selected_N, entropy_N)
        return loss_N, selected_N, entropy_N

    @staticmethod
    def backward(ctx, grad_loss_N, _grad_selected_N, _grad_entropy_N):
        hidden_ND, weight_VD, bias_V, *student_side = ctx.saved_tensors
        grads = HeadGradients(hidden_ND, weight_VD, bias_V, ctx.needs_input_grad[:3], ctx.transform)
        kept, ctx.kept = ctx.kept, None  # used once: a second backward recomputes
        gradients = grads.chunked_backward(
            grad_loss_N,
            ctx.chunk_size,
            kept,
            lambda start, end: _recomputed_gradient(ctx, grads, start, end, student_side),
        )
        return (*gradients, *[None] * 6)


def _recomputed_gradient(ctx, grads: HeadGradients, start: int, end: int, student_side: list):
    """d JSD / d z of rows ``start:end`` from both heads' logits again: ``(buffer, factor,
    dz/draw)``.

    The gradient is ``buffer * factor``: the sign and ``1 - beta`` go into the row scale.
    """
    student_lse_N, divergence_N = student_side
    student_log, derivative = grads.logits(start, end)
    student_log -= student_lse_N[start:end, None]
    teacher_log = ctx.teachers.log_probs(start, end, again=True)
    if ctx.beta == 0.0:
        student_log.exp_()
        student_log -= teacher_log.exp_()
        return student_log, 1.0, derivative
    reference_log = (
        teacher_log if ctx.beta == 1.0 else _mixture_log_(student_log, teacher_log, ctx.beta)
    )
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
    """Generalized JSD(beta) per row between ``lm_head(hidden_ND)`` and
    ``teacher_head(teacher_hidden_ND)``.

    Args:
        hidden_ND: the student's final hidden states, one row per scored position.
        lm_head: the student's output projection; gradients reach it and ``hidden_ND``.
        token_ids_N: the token each row predicts (for the returned log-probs).
        teacher_hidden_ND: the teacher's hidden states for the same rows (any dtype; no gradient).
        teacher_head: the teacher's output projection.
        beta: 0 is forward ``KL(T || S)``, 1 reverse ``KL(S || T)``, in between GKD's mixture JSD.
        chunk_size: rows whose logits exist at once (two or three ``chunk_size x V`` float32
        buffers). transform / teacher_transform: each model's logit scaling and temperature.
        vocab_size: compare the first ``vocab_size`` logits only (embeddings padded beyond the
        tokenizer).

    Returns:
        ``(loss_N, logprobs_N, entropy_N)`` in float32; gradients flow into ``loss_N`` only.
    """
    teacher = HeadRows(teacher_hidden_ND, teacher_head, teacher_transform)
    return chunked_jsd_mixed(
        hidden_ND,
        lm_head,
        token_ids_N,
        [teacher],
        beta,
        chunk_size=chunk_size,
        transform=transform,
        vocab_size=vocab_size,
    )


def chunked_jsd_mixed(
    hidden_ND: torch.Tensor,
    lm_head: nn.Linear,
    token_ids_N: torch.Tensor,
    teachers: Sequence[HeadRows],
    beta: float,
    *,
    chunk_size: int = 1024,
    transform: LogitTransform = PLAIN_LOGITS,
    vocab_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`chunked_jsd` against ``T = sum_i w_i T_i`` per row: a mixture of teachers, or rows
    of several teachers (each row's own at weight 1, the others 0). Each row's weights sum to 1."""
    check_head_rows(hidden_ND, token_ids_N, chunk_size)
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must be in [0, 1], got {beta}")
    weight, bias = head_weights(lm_head, vocab_size)
    heads = []
    for teacher in teachers:
        if teacher.hidden_ND.shape[0] != hidden_ND.shape[0]:
            raise ValueError(
                f"student and teacher must score the same rows; got {hidden_ND.shape[0]} and "
                f"{teacher.hidden_ND.shape[0]}"
            )
        teacher_weight, teacher_bias = head_weights(teacher.head, vocab_size)
        if teacher_weight.shape[0] != weight.shape[0]:
            raise ValueError(
                f"student and teacher heads must cover the same vocabulary; got {weight.shape[0]} "
                f"and {teacher_weight.shape[0]} rows (set vocab_size to the tokenizer's)"
            )
        log_weight = None
        if teacher.weight_N is not None and not bool((teacher.weight_N == 1).all()):
            log_weight = teacher.weight_N.to(device=hidden_ND.device, dtype=torch.float32).log()
        heads.append(
            _Head(
                teacher.hidden_ND.detach(),
                teacher_weight.detach(),
                None if teacher_bias is None else teacher_bias.detach(),
                teacher.head_transform,
                log_weight,
            )
        )
    return _ChunkedJSD.apply(
        hidden_ND,
        weight,
        bias,
        _TeacherHeads(heads),
        token_ids_N,
        float(beta),
        chunk_size,
        transform,
        head_gradient_expected(hidden_ND, lm_head),
    )
