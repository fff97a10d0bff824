"""Token log-probabilities without ever holding the B x T x V logits tensor.

The language-model head is applied a chunk of positions at a time; the backward pass
recomputes each chunk's logits instead of keeping them. Peak extra memory is one
``chunk_size x V`` block, whatever the batch or sequence length.

Logits go through the same transforms the model's own forward applies (``logit_scale``,
``logits_scaling``, ``final_logit_softcapping``), then a sampling temperature, and are
sliced to the tokenizer's vocabulary when the embedding matrix is padded beyond it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from opd.packing import is_right_padded, packed_hidden_states, packed_rows


@dataclass(frozen=True)
class LogitTransform:
    """How raw lm-head outputs become the logits a distribution is taken over.

    ``z = softcap * tanh(scale * raw / softcap) / temperature`` (no tanh when ``softcap`` is None).
    """

    scale: float = 1.0
    softcap: float | None = None
    temperature: float = 1.0

    def apply(self, raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | float]:
        """Return the transformed logits and dz/draw (a tensor, or a constant).

        Without a softcap the logits are scaled once, and not at all by a factor of 1 (each
        pass over a chunk x V block costs as much as a small matmul on a CPU).
        """
        if self.softcap is None:
            factor = self.scale / self.temperature
            return (raw if factor == 1.0 else raw * factor), factor
        squashed = torch.tanh(raw * self.scale / self.softcap)
        derivative = (1.0 - squashed.square()) * (self.scale / self.temperature)
        return squashed * (self.softcap / self.temperature), derivative


PLAIN_LOGITS = LogitTransform()
"""No scaling, no softcap, temperature 1."""


def logit_transform_for(model: nn.Module, temperature: float = 1.0) -> LogitTransform:
    """Read the logit scaling a Hugging Face model applies in its own forward."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    scale = float(getattr(config, "logit_scale", None) or 1.0)
    logits_scaling = getattr(config, "logits_scaling", None)
    if logits_scaling:
        scale /= float(logits_scaling)
    softcap = getattr(config, "final_logit_softcapping", None)
    return LogitTransform(scale=scale, softcap=float(softcap) if softcap else None, temperature=temperature)


def head_weights(lm_head: nn.Linear, vocab_size: int | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The lm head's weight and bias, cut to the first ``vocab_size`` rows (the tokenizer's ids)."""
    weight, bias = lm_head.weight, lm_head.bias
    if vocab_size is not None and vocab_size < weight.shape[0]:
        weight = weight[:vocab_size]
        bias = bias[:vocab_size] if bias is not None else None
    return weight, bias


def chunk_logits(
    hidden_chunk: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, transform: LogitTransform
) -> tuple[torch.Tensor, torch.Tensor | float]:
    raw = hidden_chunk @ weight.T
    if bias is not None:
        raw = raw + bias
    return transform.apply(raw.float())


def chunk_logits_inplace(
    hidden_chunk: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, transform: LogitTransform
) -> torch.Tensor:
    """Transformed float32 logits of a chunk in one buffer (no derivative kept)."""
    logits = (hidden_chunk @ weight.T).float()
    if bias is not None:
        logits += bias
    if transform.softcap is not None:
        return transform.apply(logits)[0]
    factor = transform.scale / transform.temperature
    if factor != 1.0:
        logits *= factor
    return logits


def row_dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``(a * b).sum(-1)`` without the product's ``chunk x V`` buffer."""
    return (a.unsqueeze(-2) @ b.unsqueeze(-1)).view(-1)


def refuse_ids_outside(ids: torch.Tensor, vocab_size: int, what: str) -> None:
    """A clear error for an id past the head's rows, instead of an index error inside a gather."""
    if ids.numel() and int(ids.max()) >= vocab_size:
        raise ValueError(f"{what} {int(ids.max())} is outside the model's vocabulary of {vocab_size}")


def head_gradient_expected(hidden_ND: torch.Tensor, lm_head: nn.Module) -> bool:
    """Whether autograd will differentiate through the head now (forward then keeps a gradient)."""
    if not torch.is_grad_enabled():
        return False
    return hidden_ND.requires_grad or any(p.requires_grad for p in lm_head.parameters())


def backward_chunk_starts(rows: int, chunk_size: int, last_kept: bool) -> list[int]:
    """The chunks' first rows in the order backward visits them.

    A chunk whose gradient forward kept goes first, so its buffer is freed before any other
    chunk's logits are rebuilt (one ``chunk x V`` buffer alive at a time, as without it).
    """
    starts = list(range(0, rows, chunk_size))
    return starts[-1:] + starts[:-1] if last_kept else starts


class _SelectedTokenLogProbs(torch.autograd.Function):
    """log softmax(z)[token] and the entropy of softmax(z), chunk by chunk, recomputed in backward.

    Every V-wide step works in place, so a chunk needs one float32 ``chunk x V`` buffer (two
    when the entropy is asked for), and backward redoes one matmul per chunk instead of
    keeping the logits, except for the last chunk: when a gradient will be asked for, forward
    keeps that chunk's probabilities (already in one of its buffers), so with a single chunk
    backward recomputes nothing.
    """

    @staticmethod
    def forward(
        ctx, hidden_ND, weight_VD, bias_V, token_ids_N, chunk_size, transform, with_entropy, keep_last
    ):
        rows = hidden_ND.shape[0]
        logprobs_N = hidden_ND.new_empty(rows, dtype=torch.float32)
        entropy_N = torch.zeros_like(logprobs_N)
        logsumexp_N = torch.empty_like(logprobs_N)
        ctx.kept_probs = None
        for start in range(0, rows, chunk_size):
            end = start + chunk_size
            shifted = chunk_logits_inplace(hidden_ND[start:end], weight_VD, bias_V, transform)
            row_max = shifted.amax(dim=-1)
            selected = shifted.gather(-1, token_ids_N[start:end, None]).squeeze(-1)
            shifted -= row_max[:, None]
            if with_entropy:
                exps = torch.exp(shifted)
                total = exps.sum(-1)
                weighted = row_dot(exps, shifted)
                entropy_N[start:end] = torch.log(total) - weighted / total
            else:
                exps = shifted.exp_()
                total = exps.sum(-1)
            if keep_last and end >= rows and transform.softcap is None:
                ctx.kept_probs = exps.div_(total[:, None])
            lse = row_max + torch.log(total)
            logprobs_N[start:end] = selected - lse
            logsumexp_N[start:end] = lse
            del shifted, exps
        ctx.save_for_backward(hidden_ND, weight_VD, bias_V, token_ids_N, logsumexp_N)
        ctx.chunk_size = chunk_size
        ctx.transform = transform
        ctx.mark_non_differentiable(entropy_N)
        return logprobs_N, entropy_N

    @staticmethod
    def backward(ctx, grad_logprobs_N, _grad_entropy_N):
        hidden_ND, weight_VD, bias_V, token_ids_N, logsumexp_N = ctx.saved_tensors
        grads = HeadGradients(hidden_ND, weight_VD, bias_V, ctx.needs_input_grad[:3], ctx.transform)
        kept_probs, ctx.kept_probs = ctx.kept_probs, None  # used once: a second backward recomputes
        rows = hidden_ND.shape[0]
        for start in backward_chunk_starts(rows, ctx.chunk_size, kept_probs is not None):
            end = start + ctx.chunk_size
            grad_out = grad_logprobs_N[start:end] * grads.constant_factor
            if kept_probs is not None and end >= rows:
                grad_raw, derivative, kept_probs = kept_probs, None, None
            else:
                grad_raw, derivative = grads.logits(start, end)
                grad_raw -= logsumexp_N[start:end, None]
                grad_raw.exp_()
            grad_raw *= -grad_out[:, None]
            chunk_rows = torch.arange(grad_raw.shape[0], device=grad_raw.device)
            grad_raw[chunk_rows, token_ids_N[start:end]] += grad_out
            grads.add(start, end, grad_raw, derivative)
            del grad_raw
        return (*grads.result(), None, None, None, None, None)


class HeadGradients:
    """Gradients of ``transform(hidden @ weight.T + bias)`` accumulated chunk by chunk.

    Shared by the fused head Functions: each recomputes a chunk's logits with :meth:`logits`,
    turns them in place into d loss / d logits, and hands them to :meth:`add`, which chains
    through the transform and the matmul. A constant transform factor is left to the caller
    (``constant_factor``: folding it into a per-row scale saves a pass over the chunk).
    """

    def __init__(self, hidden_ND, weight_VD, bias_V, needs_grad, transform: LogitTransform):
        need_hidden, need_weight, need_bias = needs_grad
        self.hidden_ND, self.weight_VD, self.bias_V, self.transform = hidden_ND, weight_VD, bias_V, transform
        self.grad_hidden = torch.zeros_like(hidden_ND) if need_hidden else None
        self.grad_weight = torch.zeros_like(weight_VD, dtype=torch.float32) if need_weight else None
        self.grad_bias = torch.zeros_like(bias_V, dtype=torch.float32) if need_bias else None
        self.constant_factor = transform.scale / transform.temperature if transform.softcap is None else 1.0

    def logits(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The chunk's float32 logits (a fresh buffer to overwrite) and, with a softcap, dz/draw."""
        hidden_chunk = self.hidden_ND[start:end]
        if self.transform.softcap is None:
            return chunk_logits_inplace(hidden_chunk, self.weight_VD, self.bias_V, self.transform), None
        return chunk_logits(hidden_chunk, self.weight_VD, self.bias_V, self.transform)

    def add(self, start: int, end: int, grad_logits: torch.Tensor, derivative: torch.Tensor | None) -> None:
        """Chain d loss / d logits of rows ``start:end`` into the hidden, weight and bias grads."""
        if derivative is not None:
            grad_logits *= derivative
        hidden_chunk = self.hidden_ND[start:end]
        if self.grad_hidden is not None:
            weight = self.weight_VD
            self.grad_hidden[start:end] = (grad_logits.to(weight.dtype) @ weight).to(hidden_chunk.dtype)
        if self.grad_weight is not None:
            self.grad_weight.addmm_(grad_logits.T, hidden_chunk.float())
        if self.grad_bias is not None:
            self.grad_bias += grad_logits.sum(0)

    def result(self) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """``(grad_hidden, grad_weight, grad_bias)`` in their parameters' dtypes."""
        grad_weight = None if self.grad_weight is None else self.grad_weight.to(self.weight_VD.dtype)
        grad_bias = None if self.grad_bias is None else self.grad_bias.to(self.bias_V.dtype)
        return self.grad_hidden, grad_weight, grad_bias


def selected_token_logprobs(
    hidden_ND: torch.Tensor,
    lm_head: nn.Linear,
    token_ids_N: torch.Tensor,
    *,
    chunk_size: int = 1024,
    transform: LogitTransform = LogitTransform(),
    vocab_size: int | None = None,
    with_entropy: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probabilities of ``token_ids_N`` under ``lm_head(hidden_ND)``, and the entropies.

    Args:
        hidden_ND: final hidden states, one row per scored position (the position *before*
            the token it predicts).
        lm_head: the output projection (tied embeddings work: its weight is the embedding).
        token_ids_N: the token each row is scored on.
        chunk_size: rows whose logits exist at once; memory is ``chunk_size x V`` floats.
        transform: logit scaling, soft-capping and temperature.
        vocab_size: normalise over the first ``vocab_size`` rows only (an embedding padded
            beyond the tokenizer), so two models with padded vocabularies stay comparable.
        with_entropy: also compute each row's entropy (one more V-wide buffer and pass);
            zeros are returned when False.

    Returns:
        ``(logprobs_N, entropy_N)`` in float32; gradients flow into ``logprobs_N`` only.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if hidden_ND.dim() != 2 or token_ids_N.dim() != 1 or hidden_ND.shape[0] != token_ids_N.shape[0]:
        raise ValueError(
            f"hidden states must be (N, D) and token ids (N,); got {tuple(hidden_ND.shape)} "
            f"and {tuple(token_ids_N.shape)}"
        )
    weight, bias = head_weights(lm_head, vocab_size)
    refuse_ids_outside(token_ids_N, weight.shape[0], "token id")
    keep_last = head_gradient_expected(hidden_ND, lm_head)
    return _SelectedTokenLogProbs.apply(
        hidden_ND, weight, bias, token_ids_N, chunk_size, transform, with_entropy, keep_last
    )


def unwrap_peft(model: nn.Module) -> nn.Module:
    """The Hugging Face model inside a PEFT wrapper (adapter layers included), or ``model`` itself."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def backbone_and_head(model: nn.Module) -> tuple[nn.Module, nn.Linear]:
    """The transformer body (returns hidden states) and the lm head of a causal LM, PEFT or not."""
    base = unwrap_peft(model)
    backbone = getattr(base, base.base_model_prefix, None)
    head = base.get_output_embeddings()
    if backbone is None or head is None:
        raise TypeError(f"{type(base).__name__} has no '{base.base_model_prefix}' body or no lm head")
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
    with torch.autocast(input_ids_BT.device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
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
    transform: LogitTransform = LogitTransform(),
    vocab_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The k most likely token ids and their log-probs per row, chunk by chunk (no gradient)."""
    weight, bias = head_weights(lm_head, vocab_size)
    ids, values = [], []
    for start in range(0, hidden_ND.shape[0], chunk_size):
        logits, _ = chunk_logits(hidden_ND[start : start + chunk_size], weight, bias, transform)
        top = torch.log_softmax(logits, dim=-1).topk(k, dim=-1)
        ids.append(top.indices)
        values.append(top.values)
    if not ids:
        return hidden_ND.new_zeros(0, k, dtype=torch.long), hidden_ND.new_zeros(0, k, dtype=torch.float32)
    return torch.cat(ids), torch.cat(values)
