"""Token log-probabilities without ever holding the B x T x V logits tensor.

The language-model head is applied a chunk of positions at a time; the backward pass
recomputes each chunk's logits instead of keeping them. Peak extra memory is one
``chunk_size x V`` block, whatever the batch or sequence length.

Logits go through the same transforms the model's own forward applies (``logit_scale``,
``logits_scaling``, ``final_logit_softcapping``), then a sampling temperature, and are
sliced to the tokenizer's vocabulary when the embedding matrix is padded beyond it.

    transform  the logit transform and chunked logits
    head       the chunked lm-head autograd scaffold shared by every fused head
    forward    the body's forward, packed or padded, and the scored rows
    (here)     the public API: :func:`sequence_logprobs`, :func:`topk_logprobs`
"""

from __future__ import annotations

import torch
from torch import nn

from opd.logprobs.forward import (
    RowsFunction,
    ScoredRows,
    backbone_and_head,
    flat_rows,
    scatter_rows,
    scored_hidden_states,
    unwrap_peft,
)
from opd.logprobs.head import (
    HeadGradients,
    backward_chunk_starts,
    check_head_rows,
    head_gradient_expected,
    logit_chunks,
    selected_token_logprobs,
)
from opd.logprobs.transform import (
    PLAIN_LOGITS,
    LogitTransform,
    chunk_logits,
    chunk_logits_inplace,
    head_weights,
    logit_transform_for,
    refuse_ids_outside,
    row_dot,
)

__all__ = [
    "PLAIN_LOGITS",
    "HeadGradients",
    "LogitTransform",
    "RowsFunction",
    "ScoredRows",
    "backbone_and_head",
    "backward_chunk_starts",
    "check_head_rows",
    "chunk_logits",
    "chunk_logits_inplace",
    "flat_rows",
    "head_gradient_expected",
    "head_weights",
    "logit_chunks",
    "logit_transform_for",
    "refuse_ids_outside",
    "row_dot",
    "scatter_rows",
    "scored_hidden_states",
    "selected_token_logprobs",
    "sequence_logprobs",
    "topk_logprobs",
    "unwrap_peft",
]


def sequence_logprobs(
    model: nn.Module,
    input_ids_BT: torch.Tensor,
    attention_mask_BT: torch.Tensor,
    score_mask_BT: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    vocab_size: int | None = None,
    autocast_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log p(x_t | x_<t) and entropy at every position where ``score_mask_BT`` is set.

    Only the scored positions go through the lm head. Position 0 cannot be scored (nothing
    predicts it); outputs are (B, T) and zero where not scored. ``autocast_dtype``: as in
    :func:`scored_hidden_states`.
    """
    hidden_ND, token_ids_N, selected_BT = scored_hidden_states(
        model, input_ids_BT, attention_mask_BT, score_mask_BT, autocast_dtype=autocast_dtype
    )
    _, head = backbone_and_head(model)
    logprobs_N, entropy_N = selected_token_logprobs(
        hidden_ND,
        head,
        token_ids_N,
        chunk_size=chunk_size,
        transform=logit_transform_for(model, temperature),
        vocab_size=vocab_size,
    )
    return scatter_rows(logprobs_N, selected_BT), scatter_rows(entropy_N, selected_BT)


@torch.no_grad()
def topk_logprobs(
    hidden_ND: torch.Tensor,
    lm_head: nn.Linear,
    k: int,
    *,
    chunk_size: int = 1024,
    transform: LogitTransform = PLAIN_LOGITS,
    vocab_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The k most likely token ids and their log-probs per row, chunk by chunk (no gradient)."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    weight, bias = head_weights(lm_head, vocab_size)
    ids, values = [], []
    for _, _, logits in logit_chunks(hidden_ND, weight, bias, transform, chunk_size):
        top = torch.log_softmax(logits, dim=-1).topk(k, dim=-1)
        ids.append(top.indices)
        values.append(top.values)
    if not ids:
        return hidden_ND.new_zeros(0, k, dtype=torch.long), hidden_ND.new_zeros(
            0, k, dtype=torch.float32
        )
    return torch.cat(ids), torch.cat(values)
