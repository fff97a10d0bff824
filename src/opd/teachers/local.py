"""A teacher model in the trainer's process, scored in no-grad forwards."""

from __future__ import annotations

import torch

from opd.logprobs import sequence_logprobs


def pad_right(sequences: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T) ids and attention mask, right-padded."""
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    attention = torch.zeros_like(ids)
    for row, sequence in enumerate(sequences):
        ids[row, : len(sequence)] = torch.tensor(sequence)
        attention[row, : len(sequence)] = 1
    return ids, attention


class LocalTeacher:
    """Log q(x_t | x_<t) of a Hugging Face model for the scored positions of each sequence."""

    def __init__(self, model, *, vocab_size: int, pad_id: int, batch_size: int = 32, chunk_size: int = 1024):
        self.model = model.eval()
        self.vocab_size = vocab_size
        self.pad_id = pad_id
        self.batch_size = batch_size
        self.chunk_size = chunk_size

    @torch.no_grad()
    def score(self, sequences: list[list[int]], score_masks: list[list[bool]]) -> list[torch.Tensor]:
        """One float32 tensor per sequence, as long as it, zero where the mask is off."""
        device = next(self.model.parameters()).device
        results: list[torch.Tensor] = []
        for start in range(0, len(sequences), self.batch_size):
            chunk = sequences[start : start + self.batch_size]
            ids, attention = pad_right(chunk, self.pad_id)
            masks = score_masks[start : start + self.batch_size]
            mask, _ = pad_right(
                [[int(m) for m in ms[: len(seq)]] for ms, seq in zip(masks, chunk, strict=True)], 0
            )
            logprobs, _ = sequence_logprobs(
                self.model,
                ids.to(device),
                attention.to(device),
                mask.to(device),
                chunk_size=self.chunk_size,
                vocab_size=self.vocab_size,
            )
            results += [logprobs[row, : len(seq)].cpu() for row, seq in enumerate(chunk)]
        return results
