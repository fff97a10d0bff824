"""The forward plumbing: the model's body run once (padded or packed), the hidden states of the
scored positions taken out, and the per-row results put back in their (B, T) places."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from opd.packing import is_right_padded, packed_hidden_states, packed_rows


def unwrap_peft(model: nn.Module) -> nn.Module:
    """The Hugging Face model inside a PEFT wrapper (adapter layers included), or ``model``
    itself."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def backbone_and_head(model: nn.Module) -> tuple[nn.Module, nn.Linear]:
    """The transformer body (returns hidden states) and the lm head of a causal LM, PEFT or not."""
    base = unwrap_peft(model)
    backbone = getattr(base, base.base_model_prefix, None)
    head = base.get_output_embeddings()
    if backbone is None or head is None:
        raise TypeError(
            f"{type(base).__name__} has no '{base.base_model_prefix}' body or no lm head"
        )
    return backbone, head


def scored_hidden_states(
    model: nn.Module,
    input_ids_BT: torch.Tensor,
    attention_mask_BT: torch.Tensor,
    score_mask_BT: torch.Tensor,
    *,
    autocast_dtype: torch.dtype | None = None,
    packed: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Final hidden states that predict each scored token, without applying the lm head.

    Returns ``(hidden_ND, token_ids_N, selected_BT)``: one row per position t >= 1 with
    ``score_mask_BT[t]`` set (the hidden state at t - 1 predicts token t), row-major order,
    and the (B, T - 1) boolean map of those positions for :func:`scatter_rows`. With
    ``autocast_dtype`` the body runs under ``torch.autocast`` and the hidden states come back
    in the head's dtype, so the lm head and everything after it run at full precision.
    ``packed``: the rows (right-padded) run as one padding-free sequence (:mod:`opd.packing`;
    the caller checked the model with :func:`opd.packing.packing_problem`); otherwise the batch
    runs padded to its longest row.
    """
    backbone, head = backbone_and_head(model)
    selected_BT = score_mask_BT[:, 1:].bool()
    token_ids_N = input_ids_BT[:, 1:][selected_BT]
    right_padded = is_right_padded(attention_mask_BT)
    width = attention_mask_BT.shape[1]
    if right_padded and attention_mask_BT.numel():  # columns of padding only: not computed
        width = max(int(attention_mask_BT.sum(-1).max()), 1)
    with torch.autocast(
        input_ids_BT.device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None
    ):
        if packed and right_padded:
            hidden_ND = packed_hidden_states(backbone, input_ids_BT, attention_mask_BT)
            hidden_ND = hidden_ND[packed_rows(attention_mask_BT, selected_BT)]
        else:
            hidden_BTD = backbone(
                input_ids=input_ids_BT[:, :width],
                attention_mask=attention_mask_BT[:, :width],
                use_cache=False,
            ).last_hidden_state
            hidden_ND = hidden_BTD[:, :-1][selected_BT[:, : width - 1]]
    if autocast_dtype is not None:
        hidden_ND = hidden_ND.to(head.weight.dtype)
    return hidden_ND, token_ids_N, selected_BT


def scatter_rows(values_N: torch.Tensor, selected_BT: torch.Tensor) -> torch.Tensor:
    """Put per-row values back at their (B, T) positions (zeros elsewhere, column 0 unscored)."""
    out = values_N.new_zeros(selected_BT.shape).masked_scatter(selected_BT, values_N)
    return torch.cat([out.new_zeros(out.shape[0], 1), out], dim=1)


def flat_rows(values_BT: torch.Tensor, score_mask_BT: torch.Tensor) -> torch.Tensor:
    """The values at the scored positions t >= 1, row-major: the rows :func:`scored_hidden_states`
    yields, so a (B, T, ...) tensor about token t lines up with the hidden state that predicts it.
    The inverse of :func:`scatter_rows`."""
    return values_BT[:, 1:][score_mask_BT[:, 1:].bool().to(values_BT.device)]


RowsFunction = Callable[[torch.Tensor, torch.Tensor, nn.Module], object]
"""``(hidden_ND, token_ids_N, lm_head) -> anything``: what is computed on a model's scored rows."""


class ScoredRows(nn.Module):
    """A causal LM's forward as one module call: its body over the batch, then ``rows_function`` on
    the hidden states of the scored positions, with the lm head it should apply.

    Wrapping a model in this module, and calling it, is what makes the lm head's use (fused heads
    multiply its weight themselves) part of the forward that DDP's and FSDP's hooks wrap.
    """

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model
        self.packed = False
        """Whether the body runs each call's rows packed (:func:`scored_hidden_states`)."""

    def forward(
        self,
        input_ids_BT: torch.Tensor,
        attention_mask_BT: torch.Tensor,
        score_mask_BT: torch.Tensor,
        rows_function: RowsFunction,
        autocast_dtype: torch.dtype | None = None,
    ) -> tuple[object, torch.Tensor]:
        """``(rows_function(hidden_ND, token_ids_N, lm_head), selected_BT)``.

        See :func:`scored_hidden_states` for the rows and ``selected_BT``.
        """
        hidden_ND, token_ids_N, selected_BT = scored_hidden_states(
            self.model,
            input_ids_BT,
            attention_mask_BT,
            score_mask_BT,
            autocast_dtype=autocast_dtype,
            packed=self.packed,
        )
        return rows_function(hidden_ND, token_ids_N, backbone_and_head(self.model)[1]), selected_BT
