"""A teacher model in the trainer's process, scored in no-grad forwards."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from opd.logprobs import (
    backbone_and_head,
    logit_transform_for,
    scored_hidden_states,
    selected_token_logprobs,
    topk_logprobs,
)


def pad_right(sequences: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T) ids and attention mask, right-padded."""
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    attention = torch.zeros_like(ids)
    for row, sequence in enumerate(sequences):
        ids[row, : len(sequence)] = torch.tensor(sequence, dtype=torch.long)
        attention[row, : len(sequence)] = 1
    return ids, attention


@dataclass
class TeacherScores:
    """What a teacher says about each sequence's scored positions.

    ``logprobs[i]`` is as long as sequence i (zeros where not scored). The other fields, when
    asked for, hold one row per scored position of sequence i, in order: top-k ids and
    log-probs (n_i, k), or final hidden states (n_i, D) for full-distribution objectives.
    """

    logprobs: list[torch.Tensor]
    topk_ids: list[torch.Tensor] | None = None
    topk_logprobs: list[torch.Tensor] | None = None
    hidden: list[torch.Tensor] | None = None


class LocalTeacher:
    """Log q(x_t | x_<t) of a Hugging Face model for the scored positions of each sequence."""

    def __init__(self, model, *, vocab_size: int, pad_id: int, batch_size: int = 32, chunk_size: int = 1024):
        self.model = model.eval()
        self.vocab_size = vocab_size
        self.pad_id = pad_id
        self.batch_size = batch_size
        self.chunk_size = chunk_size

    @property
    def lm_head(self):
        """The teacher's output projection (for full-distribution objectives)."""
        return backbone_and_head(self.model)[1]

    @torch.no_grad()
    def score(
        self,
        sequences: list[list[int]],
        score_masks: list[list[bool]],
        *,
        topk: int = 0,
        hidden: bool = False,
        temperature: float = 1.0,
    ) -> TeacherScores:
        """Score every sequence; top-k and hidden states are at ``temperature`` when asked for."""
        device = next(self.model.parameters()).device
        head = self.lm_head
        result = TeacherScores([], [] if topk else None, [] if topk else None, [] if hidden else None)
        for start in range(0, len(sequences), self.batch_size):
            chunk = sequences[start : start + self.batch_size]
            masks = score_masks[start : start + self.batch_size]
            ids, attention = pad_right(chunk, self.pad_id)
            mask, _ = pad_right(
                [[int(m) for m in ms[: len(seq)]] for ms, seq in zip(masks, chunk, strict=True)], 0
            )
            hidden_ND, token_ids_N, selected_BT = scored_hidden_states(
                self.model, ids.to(device), attention.to(device), mask.to(device)
            )
            logprobs_N, _ = selected_token_logprobs(
                hidden_ND,
                head,
                token_ids_N,
                chunk_size=self.chunk_size,
                transform=logit_transform_for(self.model),
                vocab_size=self.vocab_size,
                with_entropy=False,
            )
            counts = selected_BT.sum(-1).tolist()
            full = torch.zeros(selected_BT.shape, device=device).masked_scatter(selected_BT, logprobs_N)
            for row, sequence in enumerate(chunk):
                result.logprobs.append(torch.cat([full.new_zeros(1), full[row]])[: len(sequence)].cpu())
            if topk:
                top_ids, top_values = topk_logprobs(
                    hidden_ND,
                    head,
                    topk,
                    chunk_size=self.chunk_size,
                    transform=logit_transform_for(self.model, temperature),
                    vocab_size=self.vocab_size,
                )
                result.topk_ids += [t.cpu() for t in top_ids.split(counts)]
                result.topk_logprobs += [t.cpu() for t in top_values.split(counts)]
            if hidden:
                result.hidden += list(hidden_ND.split(counts))
        return result
