"""Seeded sampling that does not depend on batch composition: one SplitMix64 uniform per row and
decode step from the row's own seed, turned into a token by the inverse of the cumulative
distribution. A row split onto another process, or batched with other rows, draws the same token.
"""

from __future__ import annotations

import torch


def inverse_cdf_sample(probs_BV: torch.Tensor, uniform_B: torch.Tensor) -> torch.Tensor:
    """One token per row, drawn from ``probs_BV`` (rows need not sum to 1) with the given U[0, 1)
    draws.

    Token i is taken when ``u * total`` falls in ``[cdf[i-1], cdf[i])``, so zero-probability
    tokens are never taken. The cumulative sum runs in float64, so its rounding is far below
    any probability a float32 softmax can express. One uniform number per row, where
    ``torch.multinomial`` draws one exponential per vocabulary entry (for a vocabulary of tens
    of thousands, most of a CPU decode step's sampling time). A row with no finite distribution (NaN
    logits) gets the last token, whose NaN log-prob makes the trainer skip the step.
    """
    cdf_BV = probs_BV.double().cumsum(-1)
    targets_B1 = uniform_B.double()[:, None] * cdf_BV[:, -1:]
    tokens_B = torch.searchsorted(cdf_BV, targets_B1, right=True).squeeze(-1)
    return tokens_B.clamp_(max=probs_BV.shape[-1] - 1)


def _signed(value: int) -> int:
    """A 64-bit pattern (0 <= value < 2**64) as the int64 that has its bits."""
    return value - (1 << 64) if value >= 1 << 63 else value


_GOLDEN = 0x9E3779B97F4A7C15
_MIX_1 = _signed(0xBF58476D1CE4E5B9)
_MIX_2 = _signed(0x94D049BB133111EB)


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns (torch's ``>>`` copies the sign bit)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def counter_uniform(seeds_B: torch.Tensor, step: int | list[int]) -> torch.Tensor:
    """U[0, 1) per row at decode step ``step`` (one for all rows, or each row's own): SplitMix64
    output ``step`` of the row's seed.

    A row's draws depend on its own seed and the step only (not on which rows share its batch,
    nor on any generator's state), so a batch split across processes draws what one process
    would, and a row that joins a running batch (``opd serve``) draws what it draws alone.
    int64 arithmetic wraps, as SplitMix64's unsigned arithmetic does.
    """
    steps = [step] * len(seeds_B) if isinstance(step, int) else step
    offsets = [_signed((s + 1) * _GOLDEN % (1 << 64)) for s in steps]
    z = seeds_B + torch.tensor(offsets, dtype=torch.long, device=seeds_B.device)
    z = (z ^ _shift_right(z, 30)) * _MIX_1
    z = (z ^ _shift_right(z, 27)) * _MIX_2
    z = z ^ _shift_right(z, 31)
    return _shift_right(z, 11).double() * 2.0**-53


def tempered_scores(
    logits_BV: torch.Tensor, temperature: float | torch.Tensor, vocab_size: int | None
) -> torch.Tensor:
    """``logits / temperature`` in float32 (``temperature`` one for all rows, or a (B, 1) column),
    -inf past the tokenizer's ``vocab_size``: an embedding padded beyond the vocabulary never
    gives a token the tokenizer cannot read."""
    scores_BV = logits_BV.float() / temperature
    if vocab_size is not None and vocab_size < scores_BV.shape[-1]:
        scores_BV[:, vocab_size:] = float("-inf")
    return scores_BV


def seeded_draw(
    logprobs_BV: torch.Tensor, seeds_B: torch.Tensor, step: int | list[int]
) -> torch.Tensor:
    """Each row's token drawn from ``exp(logprobs_BV)`` by its seed at its decode ``step``: the
    draw of opd's own sampler and of ``opd serve``'s decode loop alike."""
    return inverse_cdf_sample(logprobs_BV.exp(), counter_uniform(seeds_B, step))
