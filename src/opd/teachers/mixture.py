"""Teachers mixed token by token: ``q(x) = sum_i w_i q_i(x)``, from what each teacher sends.

The log-prob of a sampled token is exact (every teacher sends its own). The mixture's top-k is
read from the union of the teachers' top-k: a teacher's probability where it sent the token,
and where it did not, its tail share: the mass it left outside its top-k spread evenly over the
tokens outside it, ``r_i / (V - k)``. The true value there lies in ``[0, min(r_i, p_i(k))]``
(``p_i(k)``: its k-th probability), so each mixed probability is off by at most
``sum_i w_i min(r_i, p_i(k))`` over the teachers that did not send the token, and the mixed
top-k sums to at most 1 (docs/teachers.md).
"""

from __future__ import annotations

import torch


def mixed_logprobs(logprobs_MN: torch.Tensor, weights_M: torch.Tensor) -> torch.Tensor:
    """``log sum_i w_i q_i(x)`` per row from each teacher's ``log q_i(x)`` (M teachers, N rows)."""
    return torch.logsumexp(logprobs_MN.double() + weights_M.double().log()[:, None], dim=0).float()


def mixed_topk(
    ids_MNK: torch.Tensor,
    logprobs_MNK: torch.Tensor,
    weights_M: torch.Tensor,
    k: int,
    vocab_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The mixture's k most likely tokens per row and their log-probs, from each teacher's top-k.

    Every token some teacher sent is a candidate; its mixed probability takes each teacher's
    probability where that teacher sent it, its tail share where not. Returns ``(ids_NK,
    logprobs_NK)``, most likely first.
    """
    teachers, rows, sent = ids_MNK.shape
    probs_MNK = logprobs_MNK.double().exp()
    tail_MN = (1.0 - probs_MNK.sum(-1)).clamp(min=0.0) / max(vocab_size - sent, 1)
    candidates_NC = ids_MNK.permute(1, 0, 2).reshape(rows, teachers * sent)
    mixed_NC = torch.zeros(candidates_NC.shape, dtype=torch.float64)
    for i in range(teachers):
        match_NKC = ids_MNK[i][:, :, None] == candidates_NC[:, None, :]
        own_NC = (match_NKC * probs_MNK[i][:, :, None]).sum(1)
        has_NC = match_NKC.any(1)
        mixed_NC += weights_M[i].double() * torch.where(has_NC, own_NC, tail_MN[i][:, None])
    same_NCC = candidates_NC[:, :, None] == candidates_NC[:, None, :]
    earlier = torch.ones(same_NCC.shape[1:], dtype=torch.bool).tril(-1)
    repeated_NC = (same_NCC & earlier).any(-1)
    mixed_NC = mixed_NC.masked_fill(repeated_NC, -1.0)  # each token once
    values_NK, order_NK = mixed_NC.topk(k, dim=-1)
    return candidates_NC.gather(1, order_NK), values_NK.clamp(min=1e-30).log().float()
