"""Divergences between full next-token distributions (rows of log-probs over the vocabulary).

Pure functions on (N, V) rows; :func:`opd.logprobs.chunked_head_objective` feeds them a chunk
of rows at a time so the full B x T x V tensors never exist.
"""

from __future__ import annotations

import math

import torch


def kl_rows(p_log_NV: torch.Tensor, q_log_NV: torch.Tensor) -> torch.Tensor:
    """KL(p || q) per row, from log-probs; 0 * log 0 counts as 0."""
    p = p_log_NV.exp()
    return torch.where(p > 0, p * (p_log_NV - q_log_NV), torch.zeros_like(p)).sum(-1)


def generalized_jsd(student_log_NV: torch.Tensor, teacher_log_NV: torch.Tensor, beta: float) -> torch.Tensor:
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
    return beta * kl_rows(teacher_log_NV, mixture_log) + (1.0 - beta) * kl_rows(student_log_NV, mixture_log)


TAIL_FLOOR = 1e-12


def tail_logprob(topk_log_NK: torch.Tensor) -> torch.Tensor:
    """log(1 - sum exp(topk)): the mass outside the top-k, floored at a tiny value."""
    mass = topk_log_NK.exp().sum(-1).clamp(max=1.0)
    return torch.log((1.0 - mass).clamp(min=TAIL_FLOOR))


def topk_forward_kl(
    student_log_NV: torch.Tensor, teacher_topk_ids_NK: torch.Tensor, teacher_topk_log_NK: torch.Tensor
) -> torch.Tensor:
    """Forward KL(T || S) over the teacher's top-k tokens plus one bucket for the rest.

    Both distributions are collapsed to k + 1 outcomes: the teacher's k most likely tokens
    and "anything else". Only the teacher's top-k ids and log-probs are needed, which is
    what an inference server can afford to send.
    """
    student_topk = student_log_NV.gather(-1, teacher_topk_ids_NK)
    outside = torch.ones_like(student_log_NV, dtype=torch.bool).scatter(-1, teacher_topk_ids_NK, False)
    student_tail = torch.logsumexp(student_log_NV.masked_fill(~outside, float("-inf")), dim=-1)
    student_tail = student_tail.clamp(min=math.log(TAIL_FLOOR))  # k = V leaves no tail
    teacher_tail = tail_logprob(teacher_topk_log_NK)
    head = (teacher_topk_log_NK.exp() * (teacher_topk_log_NK - student_topk)).sum(-1)
    tail = teacher_tail.exp() * (teacher_tail - student_tail)
    return head + tail
