"""Naive references the tests (and ``bench/fused_heads.py``) hold opd's fused, chunked code to.

Each is written the plain way, on full (N, V) rows or with autograd through checkpointed
chunks, so that an independent computation of the same quantity exists; none is used by opd.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from opd.logprobs import PLAIN_LOGITS, LogitTransform, chunk_logits, head_weights
from opd.objectives.topk_head import TAIL_FLOOR, tail_logprob


def kl_rows(p_log_NV: torch.Tensor, q_log_NV: torch.Tensor) -> torch.Tensor:
    """KL(p || q) per row, from log-probs; 0 * log 0 counts as 0."""
    p = p_log_NV.exp()
    return torch.where(p > 0, p * (p_log_NV - q_log_NV), torch.zeros_like(p)).sum(-1)


def generalized_jsd(
    student_log_NV: torch.Tensor, teacher_log_NV: torch.Tensor, beta: float
) -> torch.Tensor:
    """GKD's generalized Jensen-Shannon divergence per row (TRL semantics).

    ``M = (1 - beta) S + beta T``; ``JSD = beta KL(T || M) + (1 - beta) KL(S || M)``. The
    endpoints are the plain KLs: ``beta = 0`` is forward ``KL(T || S)`` and ``beta = 1``
    is reverse ``KL(S || T)`` (the interior formula would vanish there).
    """
    if beta == 0.0:
        return kl_rows(teacher_log_NV, student_log_NV)
    if beta == 1.0:
        return kl_rows(student_log_NV, teacher_log_NV)
    mixture_log = torch.logsumexp(
        torch.stack([student_log_NV + math.log(1.0 - beta), teacher_log_NV + math.log(beta)]), dim=0
    )
    return beta * kl_rows(teacher_log_NV, mixture_log) + (1.0 - beta) * kl_rows(
        student_log_NV, mixture_log
    )


def topk_forward_kl(
    student_log_NV: torch.Tensor,
    teacher_topk_ids_NK: torch.Tensor,
    teacher_topk_log_NK: torch.Tensor,
) -> torch.Tensor:
    """Forward KL(T || S) over the teacher's top-k tokens plus one bucket for the rest.

    Both distributions are collapsed to k + 1 outcomes: the teacher's k most likely tokens
    and "anything else". Only the teacher's top-k ids and log-probs are needed, which is
    what an inference server can afford to send.
    """
    student_topk = student_log_NV.gather(-1, teacher_topk_ids_NK)
    outside = torch.ones_like(student_log_NV, dtype=torch.bool).scatter(
        -1, teacher_topk_ids_NK, False
    )
    student_tail = torch.logsumexp(student_log_NV.masked_fill(~outside, float("-inf")), dim=-1)
    student_tail = student_tail.clamp(min=math.log(TAIL_FLOOR))  # k = V leaves no tail
    teacher_tail = tail_logprob(teacher_topk_log_NK)
    head = (teacher_topk_log_NK.exp() * (teacher_topk_log_NK - student_topk)).sum(-1)
    tail = teacher_tail.exp() * (teacher_tail - student_tail)
    return head + tail


RowLoss = Callable[[torch.Tensor, slice], torch.Tensor]
"""``(student_log_probs_cV, rows) -> loss_c``: a divergence for rows ``rows`` of the batch."""


def _head_chunk(hidden_chunk, weight, bias, token_ids_chunk, rows, row_loss, transform):
    logits, _ = chunk_logits(hidden_chunk, weight, bias, transform)
    log_probs = torch.log_softmax(logits, dim=-1)
    with torch.no_grad():
        entropy = -(log_probs.exp() * log_probs).sum(-1)
    selected = log_probs.gather(-1, token_ids_chunk[:, None]).squeeze(-1)
    return row_loss(log_probs, rows), selected.detach(), entropy


def chunked_head_objective(
    hidden_ND: torch.Tensor,
    lm_head: nn.Linear,
    token_ids_N: torch.Tensor,
    row_loss: RowLoss,
    *,
    chunk_size: int = 1024,
    transform: LogitTransform = PLAIN_LOGITS,
    vocab_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A full-distribution loss per row, computed ``chunk_size`` rows at a time.

    Each chunk runs under activation checkpointing: its logits are rebuilt in backward
    instead of stored, so memory stays at one ``chunk_size x V`` block. ``row_loss`` gets
    the student's log-softmax rows and the slice of rows they are (to find the matching
    teacher rows). Returns ``(loss_N, selected_logprobs_N, entropy_N)``, the last two detached.
    """
    weight, bias = head_weights(lm_head, vocab_size)
    losses, selected, entropies = [], [], []
    for start in range(0, hidden_ND.shape[0], chunk_size):
        rows = slice(start, min(start + chunk_size, hidden_ND.shape[0]))
        outputs = checkpoint(
            _head_chunk,
            hidden_ND[rows],
            weight,
            bias,
            token_ids_N[rows],
            rows,
            row_loss,
            transform,
            use_reentrant=False,
        )
        losses.append(outputs[0])
        selected.append(outputs[1])
        entropies.append(outputs[2])
    if not losses:
        empty = hidden_ND.new_zeros(0, dtype=torch.float32)
        return empty, empty, empty
    return torch.cat(losses), torch.cat(selected), torch.cat(entropies)
