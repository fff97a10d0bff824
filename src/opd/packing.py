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

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

VARLEN_IMPLEMENTATIONS = ("flash_attention_2", "flash_attention_3")
"""Attention implementations that read ``cu_seq_lens_*`` themselves (their varlen kernels)."""
PER_SEQUENCE = "opd_packed_sdpa"
"""opd's attention: sdpa on each packed sequence alone."""


def _text_config(model: nn.Module):
    return (
        model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    )


def packing_problem(model: nn.Module) -> str | None:
    """Why ``model``'s forward cannot run packed rows (None when it can)."""
    config = _text_config(model)
    implementation = getattr(config, "_attn_implementation", None)
    name = type(model).__name__
    if not getattr(model, "_supports_attention_backend", False):
        return f"{name} does not use transformers' attention interface"
    if implementation not in (*VARLEN_IMPLEMENTATIONS, "sdpa", PER_SEQUENCE):
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


def packed_hidden_states(
    backbone: nn.Module, input_ids_BT: torch.Tensor, attention_mask_BT: torch.Tensor
):
    """The backbone's final hidden state at every real token, one row each in row-major order (N,
    D).

    ``attention_mask_BT`` must be right-padded (:func:`is_right_padded`); position ids count from 0
    in every sequence, as the padded forward's do. The model must be routed by
    :func:`use_packed_attention` (or run flash attention).
    """
    valid_BT = attention_mask_BT.bool()
    lengths_B = valid_BT.sum(-1)
    lengths_B = lengths_B[lengths_B > 0]
    positions_BT = torch.arange(valid_BT.shape[1], device=valid_BT.device).expand_as(valid_BT)
    bounds = torch.nn.functional.pad(lengths_B.cumsum(0), (1, 0)).to(torch.int32)
    longest = int(lengths_B.max())
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


def use_packed_attention(model: nn.Module, enabled: bool = True) -> None:
    """Route ``model``'s sdpa through :func:`per_sequence_sdpa` (or back), for as long as it packs.

    The route is the config's attention implementation and stays set between forwards: a
    backward that recomputes a layer (gradient checkpointing) looks the implementation up again
    after the forward has returned, and another thread may use the model meanwhile. Without
    sequence bounds the route is plain sdpa with sdpa's mask, so the padded forwards and
    generation of the same model are unchanged; flash attention reads the bounds itself."""
    config = _text_config(model)
    if enabled and config._attn_implementation == "sdpa":
        config._attn_implementation = PER_SEQUENCE
    elif not enabled and config._attn_implementation == PER_SEQUENCE:
        config._attn_implementation = "sdpa"


def per_sequence_sdpa(module, query, key, value, attention_mask, *, cu_seq_lens_q=None, **kwargs):
    """sdpa on each packed sequence's slice of the (1, heads, N, d) queries, keys and values; a
    call without sequence bounds (not packed) is plain sdpa."""
    if cu_seq_lens_q is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    kwargs = {
        k: v
        for k, v in kwargs.items()
        if k not in ("cu_seq_lens_k", "max_length_q", "max_length_k")
    }
    bounds = cu_seq_lens_q.tolist()
    outputs = [  # each sequence causal on its own: no mask over the packed row
        sdpa_attention_forward(
            module,
            query[:, :, start:end],
            key[:, :, start:end],
            value[:, :, start:end],
            None,
            **kwargs,
        )[0]
        for start, end in itertools.pairwise(bounds)
    ]
    return torch.cat(outputs, dim=1), None


def sdpa_mask_unless_packed(*args, attention_mask: torch.Tensor | None = None, **kwargs):
    """sdpa's mask for a padded batch; none without a padding mask (a packed row, whose sequences
    :func:`per_sequence_sdpa` keeps apart, or an unpadded one, causal by itself), so no
    block-diagonal mask over a packed row is ever built."""
    if attention_mask is None:
        return None
    return sdpa_mask(*args, attention_mask=attention_mask, **kwargs)


AttentionInterface.register(PER_SEQUENCE, per_sequence_sdpa)
AttentionMaskInterface.register(PER_SEQUENCE, sdpa_mask_unless_packed)
