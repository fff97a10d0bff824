"""Padding-free forwards: a micro-batch's sequences concatenated into one row.

Position ids restart at every sequence and attention stays inside each, through Hugging Face's
own packed-sequence interface: the ``cu_seq_lens_*`` / ``max_length_*`` keyword arguments a model
hands to its attention function. A model loaded with flash attention runs its varlen kernel on
them; a model on sdpa runs opd's per-sequence attention (registered with transformers'
``AttentionInterface``), which calls sdpa once per sequence, so no compute and no mask is spent
across sequences or on padding (a block-diagonal mask over the packed row would cost attention
over every pair of its tokens: docs/benchmarks.md). Packing computes what the padded forward
does, up to float rounding.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

VARLEN_IMPLEMENTATIONS = ("flash_attention_2", "flash_attention_3")
"""Attention implementations that read ``cu_seq_lens_*`` themselves (their varlen kernels)."""
PER_SEQUENCE = "opd_packed_sdpa"
"""opd's attention: sdpa on each packed sequence alone."""


def packing_problem(model: nn.Module) -> str | None:
    """Why ``model``'s forward cannot run packed rows (None when it can)."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    implementation = getattr(config, "_attn_implementation", None)
    name = type(model).__name__
    if not getattr(model, "_supports_attention_backend", False):
        return f"{name} does not use transformers' attention interface"
    if implementation not in (*VARLEN_IMPLEMENTATIONS, "sdpa"):
        return f"{name} runs attention '{implementation}' (packing needs sdpa or flash attention)"
    window = getattr(config, "sliding_window", None)
    if (
        window
        and getattr(config, "use_sliding_window", True)
        and implementation not in VARLEN_IMPLEMENTATIONS
    ):
        return f"{name} has sliding-window attention, which packs under flash attention only"
    return None


def is_right_padded(attention_mask_BT: torch.Tensor) -> bool:
    """Whether every row's tokens come first, then its padding (the layout packing reads)."""
    return bool((attention_mask_BT.cumprod(-1) == attention_mask_BT).all())


def packed_hidden_states(backbone: nn.Module, input_ids_BT: torch.Tensor, attention_mask_BT: torch.Tensor):
    """The backbone's final hidden state at every real token, one row each in row-major order (N, D).

    ``attention_mask_BT`` must be right-padded (:func:`is_right_padded`); position ids count from 0
    in every sequence, as the padded forward's do.
    """
    valid_BT = attention_mask_BT.bool()
    lengths_B = valid_BT.sum(-1)
    lengths_B = lengths_B[lengths_B > 0]
    positions_BT = torch.arange(valid_BT.shape[1], device=valid_BT.device).expand_as(valid_BT)
    bounds = torch.nn.functional.pad(lengths_B.cumsum(0), (1, 0)).to(torch.int32)
    longest = int(lengths_B.max())
    with per_sequence_attention(backbone):
        hidden = backbone(
            input_ids=input_ids_BT[valid_BT][None],
            position_ids=positions_BT[valid_BT][None],
            use_cache=False,
            cu_seq_lens_q=bounds,
            cu_seq_lens_k=bounds,
            max_length_q=longest,
            max_length_k=longest,
        ).last_hidden_state
    return hidden[0]


def packed_rows(attention_mask_BT: torch.Tensor, selected_BT: torch.Tensor) -> torch.Tensor:
    """For each scored position (``selected_BT``, the (B, T - 1) map of positions t - 1 that predict
    a scored token t), the row of :func:`packed_hidden_states` that holds its hidden state."""
    valid_BT = attention_mask_BT.bool()
    index_BT = valid_BT.flatten().cumsum(0).view_as(valid_BT) - 1
    return index_BT[:, :-1][selected_BT]


@contextmanager
def per_sequence_attention(backbone: nn.Module) -> Iterator[None]:
    """Inside, the backbone's attention runs one sequence at a time (a varlen kernel keeps its own)."""
    config = backbone.config
    original = config._attn_implementation
    if original in VARLEN_IMPLEMENTATIONS:
        yield
        return
    config._attn_implementation = PER_SEQUENCE
    try:
        yield
    finally:
        config._attn_implementation = original


def per_sequence_sdpa(module, query, key, value, attention_mask, *, cu_seq_lens_q, **kwargs):
    """sdpa on each packed sequence's slice of the (1, heads, N, d) queries, keys and values."""
    del attention_mask  # each sequence is causal on its own: no mask over the packed row
    kwargs = {k: v for k, v in kwargs.items() if k not in ("cu_seq_lens_k", "max_length_q", "max_length_k")}
    bounds = cu_seq_lens_q.tolist()
    outputs = [
        sdpa_attention_forward(
            module, query[:, :, start:end], key[:, :, start:end], value[:, :, start:end], None, **kwargs
        )[0]
        for start, end in itertools.pairwise(bounds)
    ]
    return torch.cat(outputs, dim=1), None


AttentionInterface.register(PER_SEQUENCE, per_sequence_sdpa)
