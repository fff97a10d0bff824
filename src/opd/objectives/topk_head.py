"""The top-k forward KL on the student's head, fused and chunked, with an analytic gradient.

The top-k forward KL collapses both distributions to the teacher's k tokens ``K`` plus one
bucket for the rest. With student logits ``z``,
``S = softmax(z)``, the student's tail ``S_out = sum_{j not in K} S_j`` and the teacher's
top-k probabilities ``T_i`` and tail ``T_out`` (constants), the loss is
``sum_K T_i (log T_i - log S_i) + T_out (log T_out - log S_out)`` and its gradient is

``d loss / d z_j = S_j * W - T_j``                for ``j`` in ``K``,
``d loss / d z_j = S_j * (W - T_out / S_out)``    otherwise,

with ``W = sum_K T_i + T_out`` (1 up to rounding). Where the student's tail is floored
(``K`` covers every token, or nearly all of the mass), the tail term is a constant and drops
out of the gradient: ``W = sum_K T_i`` and no ``T_out / S_out``.

Autograd through the same computation (checkpointed chunk by chunk) keeps a
log-softmax, its exp, a mask and a masked copy per chunk and rebuilds them all in backward;
here a chunk needs two float32 ``chunk x V`` buffers, worked in place, and backward rebuilds
the logits of every chunk but the last, whose gradient forward leaves in one of its buffers.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from opd.logprobs import (
    PLAIN_LOGITS,
    HeadGradients,
    LogitTransform,
    check_head_rows,
    head_gradient_expected,
    head_weights,
    logit_chunks,
    refuse_ids_outside,
    row_dot,
)

TAIL_FLOOR = 1e-12
"""The smallest tail mass either side is given (k = V leaves none)."""
LOG_TAIL_FLOOR = math.log(TAIL_FLOOR)


def tail_logprob(topk_log_NK: torch.Tensor) -> torch.Tensor:
    """log(1 - sum exp(topk)): the mass outside the top-k, floored at a tiny value."""
    mass = topk_log_NK.exp().sum(-1).clamp(max=1.0)
    return torch.log((1.0 - mass).clamp(min=TAIL_FLOOR))


def _gradient_from_probs_(
    student_prob: torch.Tensor,
    topk_ids: torch.Tensor,
    student_topk_prob: torch.Tensor,
    teacher_topk_prob: torch.Tensor,
    weight_total: torch.Tensor,
    tail_ratio: torch.Tensor,
) -> torch.Tensor:
    """Overwrite a chunk's student probabilities with d loss / d z (see the module docstring)."""
    student_prob *= (weight_total - tail_ratio)[:, None]
    student_prob.scatter_(-1, topk_ids, student_topk_prob * weight_total[:, None])
    return student_prob.scatter_add_(-1, topk_ids, -teacher_topk_prob)


class _ChunkedTopKForwardKL(torch.autograd.Function):
    """Per-row top-k forward KL, the student's log-prob of each token and its entropy, chunk by
    chunk."""

    @staticmethod
    def forward(
        ctx,
        hidden_ND,
        weight_VD,
        bias_V,
        token_ids_N,
        topk_ids_NK,
        teacher_topk_log_NK,
        chunk_size,
        transform,
        keep_last,
    ):
        rows = hidden_ND.shape[0]
        loss_N = hidden_ND.new_empty(rows, dtype=torch.float32)
        selected_N, entropy_N = torch.empty_like(loss_N), torch.empty_like(loss_N)
        logsumexp_N, weight_total_N, tail_ratio_N = (torch.empty_like(loss_N) for _ in range(3))
        teacher_topk_log_NK = teacher_topk_log_NK.float()
        teacher_topk_prob_NK = teacher_topk_log_NK.exp()
        teacher_tail_log_N = tail_logprob(teacher_topk_log_NK)
        teacher_tail_N = teacher_tail_log_N.exp()
        ctx.kept = None
        for start, end, shifted in logit_chunks(
            hidden_ND, weight_VD, bias_V, transform, chunk_size
        ):
            ids = topk_ids_NK[start:end]
            row_max = shifted.amax(dim=-1)
            selected = shifted.gather(-1, token_ids_N[start:end, None]).squeeze(-1)
            shifted -= row_max[:, None]
            topk_shifted = shifted.gather(-1, ids)
            exps = torch.exp(shifted)
            weighted = row_dot(exps, shifted)
            del shifted
            topk_exps = exps.gather(-1, ids)
            tail_sum = exps.scatter_(-1, ids, 0.0).sum(
                -1
            )  # exact, where 1 - sum(top-k) would cancel
            total = exps.scatter_(-1, ids, topk_exps).sum(-1)
            log_total = torch.log(total)
            logsumexp = row_max + log_total
            selected_N[start:end] = selected - logsumexp
            entropy_N[start:end] = log_total - weighted / total
            student_tail_log = torch.log(tail_sum) - log_total
            floored = student_tail_log < LOG_TAIL_FLOOR
            student_tail_log = student_tail_log.clamp(min=LOG_TAIL_FLOOR)
            student_topk_log = topk_shifted - log_total[:, None]
            teacher_log, teacher_prob = (
                teacher_topk_log_NK[start:end],
                teacher_topk_prob_NK[start:end],
            )
            teacher_tail_log, teacher_tail = (
                teacher_tail_log_N[start:end],
                teacher_tail_N[start:end],
            )
            loss_N[start:end] = (teacher_prob * (teacher_log - student_topk_log)).sum(
                -1
            ) + teacher_tail * (teacher_tail_log - student_tail_log)
            tail_ratio = torch.where(floored, 0.0, teacher_tail / student_tail_log.exp())
            weight_total = teacher_prob.sum(-1) + torch.where(floored, 0.0, teacher_tail)
            logsumexp_N[start:end], weight_total_N[start:end], tail_ratio_N[start:end] = (
                logsumexp,
                weight_total,
                tail_ratio,
            )
            if keep_last and end >= rows and transform.softcap is None:
                gradient = _gradient_from_probs_(
                    exps.div_(total[:, None]),
                    ids,
                    topk_exps / total[:, None],
                    teacher_prob,
                    weight_total,
                    tail_ratio,
                )
                ctx.kept = (gradient, 1.0)
            del exps
        row_terms = (topk_ids_NK, teacher_topk_prob_NK, logsumexp_N, weight_total_N, tail_ratio_N)
        ctx.save_for_backward(hidden_ND, weight_VD, bias_V, *row_terms)
        ctx.chunk_size, ctx.transform = chunk_size, transform
        ctx.mark_non_differentiable(selected_N, entropy_N)
        return loss_N, selected_N, entropy_N

    @staticmethod
    def backward(ctx, grad_loss_N, _grad_selected_N, _grad_entropy_N):
        hidden_ND, weight_VD, bias_V, *row_terms = ctx.saved_tensors
        topk_ids_NK, teacher_topk_prob_NK, logsumexp_N, weight_total_N, tail_ratio_N = row_terms
        grads = HeadGradients(hidden_ND, weight_VD, bias_V, ctx.needs_input_grad[:3], ctx.transform)
        kept, ctx.kept = ctx.kept, None  # used once: a second backward recomputes

        def recompute(start: int, end: int) -> tuple[torch.Tensor, float, torch.Tensor | None]:
            ids = topk_ids_NK[start:end]
            student_log, derivative = grads.logits(start, end)
            student_log -= logsumexp_N[start:end, None]
            student_topk_prob = student_log.gather(-1, ids).exp_()
            gradient = _gradient_from_probs_(
                student_log.exp_(),
                ids,
                student_topk_prob,
                teacher_topk_prob_NK[start:end],
                weight_total_N[start:end],
                tail_ratio_N[start:end],
            )
            return gradient, 1.0, derivative

        gradients = grads.chunked_backward(grad_loss_N, ctx.chunk_size, kept, recompute)
        return (*gradients, *[None] * 6)


def chunked_topk_forward_kl(
    hidden_ND: torch.Tensor,
    lm_head: nn.Linear,
    token_ids_N: torch.Tensor,
    teacher_topk_ids_NK: torch.Tensor,
    teacher_topk_log_NK: torch.Tensor,
    *,
    chunk_size: int = 1024,
    transform: LogitTransform = PLAIN_LOGITS,
    vocab_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-k forward KL per row between the teacher's top-k and ``lm_head(hidden_ND)``.

    Args:
        hidden_ND: the student's final hidden states, one row per scored position.
        lm_head: the student's output projection; gradients reach it and ``hidden_ND``.
        token_ids_N: the token each row predicts (for the returned log-probs).
        teacher_topk_ids_NK / teacher_topk_log_NK: the teacher's k most likely token ids per
            row and their log-probs (a local teacher's, or what a vLLM / SGLang server sent).
        chunk_size: rows whose logits exist at once (two ``chunk_size x V`` float32 buffers).
        transform: the student's logit scaling, soft-capping and temperature.
        vocab_size: normalise over the first ``vocab_size`` logits only (an embedding padded
            beyond the tokenizer).

    Returns:
        ``(loss_N, logprobs_N, entropy_N)`` in float32; gradients flow into ``loss_N`` only.
    """
    check_head_rows(hidden_ND, token_ids_N, chunk_size)
    rows = hidden_ND.shape[0]
    if teacher_topk_ids_NK.shape != teacher_topk_log_NK.shape or teacher_topk_ids_NK.shape[:1] != (
        rows,
    ):
        raise ValueError(
            f"the teacher's top-k ids and log-probs must both be ({rows}, k), one row per scored "
            f"position; got {tuple(teacher_topk_ids_NK.shape)} and "
            f"{tuple(teacher_topk_log_NK.shape)}"
        )
    weight, bias = head_weights(lm_head, vocab_size)
    refuse_ids_outside(teacher_topk_ids_NK, weight.shape[0], "teacher top-k id")
    return _ChunkedTopKForwardKL.apply(
        hidden_ND,
        weight,
        bias,
        token_ids_N,
        teacher_topk_ids_NK,
        teacher_topk_log_NK.detach(),
        chunk_size,
        transform,
        head_gradient_expected(hidden_ND, lm_head),
    )
