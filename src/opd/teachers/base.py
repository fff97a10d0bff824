"""What a teacher is asked and what it answers: the same padded tensors for local and remote
teachers.

A teacher reads (B, T) token ids with a score mask and answers, per scored position t, the
log-prob of token t (``log q(x_t | x_<t)``), and when asked the k most likely tokens there or
the final hidden state that predicts token t (the full distribution, from a local teacher).
Everything stays laid out like the batch: position t is about token t. :meth:`TeacherScores.rows`
gives the flat views an objective works on: one row per scored position, in the order the
student's own scored rows come (:func:`opd.logprobs.flat_rows`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Protocol

import torch
from torch import nn

from opd.data.sequences import pad_right
from opd.logprobs import LogitTransform, flat_rows


@dataclass(frozen=True)
class TeacherRequest:
    """What an objective needs from the teacher at every scored position, besides its log-prob."""

    topk: int = 0
    """The k most likely tokens and their log-probs (0: none)."""
    hidden: bool = False
    """The final hidden states and the teacher's lm head: its full distribution (local teachers
    only)."""
    temperature: float = 1.0
    """Top-k and the full distribution are taken at this temperature; log-probs always at 1."""


@dataclass(frozen=True)
class TeacherInput:
    """Sequences to score: right-padded ids, their attention mask and which positions to score."""

    input_ids_BT: torch.Tensor
    attention_mask_BT: torch.Tensor
    score_mask_BT: torch.Tensor
    """True where the teacher's log-prob of the token is wanted; position 0 never is (nothing
    predicts it)."""

    @classmethod
    def from_sequences(cls, sequences: list[list[int]], score_masks: list[list[bool]], pad_id: int):
        """Pad unpadded sequences and masks (one mask entry per token) into a batch."""
        ids, attention = pad_right(sequences, pad_id)
        mask, _ = pad_right(
            [
                [int(m) for m in mask[: len(seq)]]
                for mask, seq in zip(score_masks, sequences, strict=True)
            ],
            0,
        )
        return cls(ids, attention, mask.bool())

    def select(self, rows: torch.Tensor) -> TeacherInput:
        """The sequences at indices ``rows``, cut to the longest of them."""
        attention = self.attention_mask_BT[rows]
        width = int(attention.sum(-1).max()) if rows.numel() else 0
        return TeacherInput(
            self.input_ids_BT[rows, :width], attention[:, :width], self.score_mask_BT[rows, :width]
        )


@dataclass
class HeadRows:
    """One local teacher's full distribution at some rows: its final hidden states and lm head,
    and each row's weight of it in the teacher distribution there (None: 1 on every row; a
    mixture's weight; 0 where another teacher scores the row)."""

    hidden_ND: torch.Tensor
    head: nn.Module
    head_transform: LogitTransform
    weight_N: torch.Tensor | None = None


@dataclass
class TeacherRows:
    """The teacher's answer at the scored positions only, one row per position (N rows).

    ``heads``: the teachers' full distributions whose weighted sum is each row's teacher
    distribution (one entry with no weights where one teacher scores every row)."""

    logprobs_N: torch.Tensor
    topk_ids_NK: torch.Tensor | None = None
    topk_logprobs_NK: torch.Tensor | None = None
    heads: list[HeadRows] | None = None


@dataclass
class HeadShare:
    """One local teacher's full distribution on the rows it scores in a batch composed from several
    teachers (:class:`opd.teachers.panel.TeacherPanel`): its hidden states (zero elsewhere), its lm
    head and logit transform, and each position's weight of it (1: its rows alone; a mixture's
    weight; 0: not its position)."""

    owner: object
    """What wrote it (one share per teacher reading per mixture member): never two answers in one
    share."""
    hidden_BTD: torch.Tensor
    head: nn.Module
    head_transform: LogitTransform
    weight_BT: torch.Tensor

    def select(self, rows: slice | list[int]) -> HeadShare:
        """Its share of the same rows as :meth:`TeacherScores.select`."""
        return replace(self, hidden_BTD=self.hidden_BTD[rows], weight_BT=self.weight_BT[rows])


@dataclass
class TeacherScores:
    """The teacher's side of a batch, laid out like it: position t is about token t.

    ``logprobs_BT`` (float32, 0 where not scored) always; ``topk_ids_BTK`` and ``topk_logprobs_BTK``
    when top-k was asked for; ``hidden_BTD`` (the teacher's dtype and device) with ``head`` and
    ``head_transform`` (its lm head and logit transform at the request's temperature) when the
    full distribution was, from one teacher. Composed from several teachers (per dataset, or a
    mixture), the full distributions are ``shares`` instead, one per teacher (and per mixture
    member). For a mixture's rows log-probs and top-k are the mixture's, and
    ``member_logprobs_MBT`` each teacher's log-probs.
    """

    logprobs_BT: torch.Tensor
    topk_ids_BTK: torch.Tensor | None = None
    topk_logprobs_BTK: torch.Tensor | None = None
    hidden_BTD: torch.Tensor | None = None
    head: nn.Module | None = None
    head_transform: LogitTransform | None = None
    member_logprobs_MBT: torch.Tensor | None = None
    """A mixture's rows: each teacher's own log-probs (NaN on rows no mixture scored), for the KL to
    each."""
    shares: list[HeadShare] | None = None

    @classmethod
    def zeros(cls, batch: int, width: int, request: TeacherRequest) -> TeacherScores:
        """An empty answer for a (batch, width) batch, with room for the top-k asked for.

        Hidden states are allocated by the first :meth:`put` that brings some (their width,
        dtype and device are the teacher's).
        """
        scores = cls(torch.zeros(batch, width))
        if request.topk:
            scores.topk_ids_BTK = torch.zeros(batch, width, request.topk, dtype=torch.long)
            scores.topk_logprobs_BTK = torch.zeros(batch, width, request.topk)
        return scores

    def select(self, rows: slice | list[int]) -> TeacherScores:
        """The same rows as :meth:`opd.data.sequences.RolloutBatch.select`."""

        def cut(tensor):
            return None if tensor is None else tensor[rows]

        def cut_members(tensor):
            return None if tensor is None else tensor[:, rows]

        return replace(
            self,
            logprobs_BT=self.logprobs_BT[rows],
            topk_ids_BTK=cut(self.topk_ids_BTK),
            topk_logprobs_BTK=cut(self.topk_logprobs_BTK),
            hidden_BTD=cut(self.hidden_BTD),
            member_logprobs_MBT=cut_members(self.member_logprobs_MBT),
            shares=None if self.shares is None else [share.select(rows) for share in self.shares],
        )

    def rows(self, score_mask_BT: torch.Tensor, device: torch.device | None = None) -> TeacherRows:
        """Flat views at the scored positions of ``score_mask_BT`` (moved to ``device``)."""

        def flat(tensor):
            if tensor is None:
                return None
            values = flat_rows(tensor, score_mask_BT)
            return values if device is None else values.to(device)

        heads = None
        if self.shares is not None:
            heads = [
                HeadRows(flat(s.hidden_BTD), s.head, s.head_transform, flat(s.weight_BT))
                for s in self.shares
            ]
        elif self.hidden_BTD is not None:
            heads = [HeadRows(flat(self.hidden_BTD), self.head, self.head_transform)]
        return TeacherRows(
            flat(self.logprobs_BT), flat(self.topk_ids_BTK), flat(self.topk_logprobs_BTK), heads
        )

    def put(
        self,
        row: int,
        positions: torch.Tensor,
        source: TeacherScores,
        source_row: int,
        source_positions,
        owner: object,
    ) -> None:
        """Copy the top-k and hidden states of ``source``'s row at ``source_positions`` into row
        ``row`` at ``positions`` (boolean masks with as many positions set, or slices of one
        length); the hidden states go to ``owner``'s share (its teacher reading: rows of several
        teachers each keep their own lm head)."""
        if self.topk_ids_BTK is not None:
            self.topk_ids_BTK[row, positions] = source.topk_ids_BTK[source_row, source_positions]
            self.topk_logprobs_BTK[row, positions] = source.topk_logprobs_BTK[
                source_row, source_positions
            ]
        if source.hidden_BTD is None:
            return
        self.shares = self.shares or []
        share = next((s for s in self.shares if s.owner is owner), None)
        if share is None:
            batch, width = self.logprobs_BT.shape
            hidden_BTD = source.hidden_BTD.new_zeros(batch, width, source.hidden_BTD.shape[-1])
            weight_BT = torch.zeros(batch, width)
            share = HeadShare(owner, hidden_BTD, source.head, source.head_transform, weight_BT)
            self.shares.append(share)
        share.hidden_BTD[row, positions] = source.hidden_BTD[source_row, source_positions]
        share.weight_BT[row, positions] = 1.0


class Teacher(Protocol):
    """A teacher backend (:mod:`opd.teachers.local`, :mod:`opd.teachers.remote`)."""

    def score(self, inputs: TeacherInput, request: TeacherRequest) -> TeacherScores:
        """Log q(x_t | x_<t) at every scored position, and what ``request`` asks for besides."""
        ...


def rows_by_identity(per_row: Sequence[object]) -> list[list[int]]:
    """Row indices grouped by the object each row goes to (the same teacher or writer, not an
    equal one), in first-seen order: one call per teacher for all of its rows."""
    groups: dict[int, list[int]] = {}
    for row, owner in enumerate(per_row):
        groups.setdefault(id(owner), []).append(row)
    return list(groups.values())
