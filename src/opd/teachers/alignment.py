"""Showing the teacher the student's completion in the teacher's own format and tokens.

Two mismatches are handled:

- **Chat template** (same tokenizer): the prompt is rendered with the teacher's template and
  the student's completion ids follow unchanged (the student's end-of-turn token becomes the
  teacher's), so completion positions map one to one.
- **Tokenizer**: the completion *text* is tokenized by the teacher, which scores it, and its
  answer is read per character: within a token covering ``text[a:b]``, the chance that the text
  goes on with ``text[a:c]`` is the summed probability of the teacher's likely tokens there (its
  own and the top ``teacher.character_topk``) whose text starts with it, and a character gets
  the log-ratio of its prefix to the one before. That the teacher's token *ends* at ``b`` is
  not the last letter's doing: the character after it gets the chance that the teacher ends its
  token and writes that character next, or writes a longer token going on with it (the
  end-of-turn token, the chance of ending there). So a right letter is not blamed because a
  wrong one after it changed how the teacher tokenizes the word, and where no likely token goes
  on past a token's end the per-completion total is exactly the teacher's log-prob. A student
  token's teacher log-prob is the sum over its characters: a student letter is blamed for
  itself, not for a neighbour that shares its teacher token.

Approximations: the teacher scores the student's text under its own tokenization of it, which
need not be the one it would have sampled; a prefix's probability counts only the top-k tokens
at one position (a longer token's path stops at the character after the token's end).
Characters the teacher's tokenizer cannot encode (dropped, so no teacher token covers them) are
text the teacher cannot produce: each costs ``UNCOVERED_CHAR_LOGPROB`` nats, so the student is
never rewarded for them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from opd.data.render import ChatRenderer
from opd.data.sequences import Trajectory, turn_spans
from opd.teachers.next_tokens import (
    Candidate,
    StudentVocabulary,
    TeacherReading,
    TeacherStep,
    TokenTexts,
    logsumexp,
    pad_topk,
    student_topk,
)

UNCOVERED_CHAR_LOGPROB = -20.0


def token_char_ends(tokenizer, token_ids: list[int]) -> list[int]:
    """Character offset, in ``decode(token_ids)``, where each token's text ends."""
    ends, previous = [], 0
    for count in range(1, len(token_ids) + 1):
        length = len(tokenizer.decode(token_ids[:count]))
        previous = max(previous, length)
        ends.append(previous)
    return ends


def character_logprobs(
    text: str,
    offsets: list[tuple[int, int]],
    logprobs: list[float],
    alternatives: list[list[tuple[str, float]] | None],
) -> tuple[list[float], float]:
    """The teacher's log-prob of each character of ``text`` given the text before it, and of the
    text ending after its last character (to add to the end-of-turn token's).

    ``offsets`` and ``logprobs``: each teacher token's characters and log-prob;
    ``alternatives``: per token, the text and log-prob of the other likely tokens at its
    position, or None where they cannot be compared with the text (the token's characters then
    share its whole log-prob evenly). A token whose characters another token also covers (a
    character split over byte tokens) adds to them; a token of no characters gives its log-prob
    to the next character.
    """
    chars: list[float | None] = [None] * len(text)

    def add(position: int, value: float) -> None:
        chars[position] = (chars[position] or 0.0) + value

    ending: _TokenEnd | None = None
    for (start, end), own, others in zip(offsets, logprobs, alternatives, strict=True):
        end = min(end, len(text))
        if end <= start:
            if text:
                add(min(start, len(text) - 1), own)
            ending = None
            continue
        if others is None:
            piece = [own / (end - start)] * (end - start)
        else:
            masses = [
                logsumexp([own] + [lp for other, lp in others if other.startswith(text[start:cut])])
                for cut in range(start + 1, end + 1)
            ]
            piece = [
                mass - previous for mass, previous in zip(masses, [0.0, *masses[:-1]], strict=True)
            ]
        if ending is not None and ending.at == start:
            piece[0] = ending.next_character(text[start], piece[0])
        for position, value in enumerate(piece, start):
            add(position, value)
        ending = (
            None if others is None else _TokenEnd(end, text[start:end], own, others, masses[-1])
        )
    end_logprob = 0.0 if ending is None else ending.ends_here
    return [UNCOVERED_CHAR_LOGPROB if value is None else value for value in chars], end_logprob


class _TokenEnd(NamedTuple):
    """Where a teacher token read per character ends, and what the character after it needs."""

    at: int
    token: str
    own: float
    others: list[tuple[str, float]]
    going_on: float
    """log P(the text goes on with ``token``): the token and its likely longer alternatives."""

    @property
    def ends_here(self) -> float:
        """log P(the teacher's token ends here | the text goes on with ``token``)."""
        return self.own - self.going_on

    def next_character(self, char: str, first: float) -> float:
        """The log-prob of ``char`` after the token: the teacher either ends its token here and
        starts the next with it (``first``: that token's log-prob of ``char``), or writes a longer
        token going on with it."""
        longer = [lp for other, lp in self.others if other.startswith(self.token + char)]
        return logsumexp([self.own + first, *longer]) - self.going_on


def student_token_logprobs(
    char_logprobs: list[float], student_ends: list[int], student_logprobs: list[float]
) -> list[float]:
    """A teacher log-prob per student token: the sum over its characters. A token of no
    characters (a partial byte) keeps the student's own log-prob: no signal either way."""
    out, start = [], 0
    for end, own in zip(student_ends, student_logprobs, strict=True):
        end = min(end, len(char_logprobs))
        out.append(sum(char_logprobs[start:end]) if end > start else own)
        start = max(start, end)
    return out


@dataclass
class TurnPiece:
    """One student turn as the teacher reads it, and how to map its answer back."""

    start: int
    """Where the turn begins in the teacher's token ids."""
    length: int
    """The turn's tokens in the teacher's ids (its end of turn included)."""
    text: str | None = None
    """Cross-tokenizer only: the turn's text (less the end of turn), which both tokenize."""
    teacher_offsets: list[tuple[int, int]] | None = None
    student_ends: list[int] | None = None
    ends_with_stop: bool = False


@dataclass
class TeacherInput:
    """What the teacher scores for one rollout (one turn, or an episode's), and where its turns
    lie."""

    token_ids: list[int]
    score_mask: list[bool]
    turns: list[TurnPiece]


class TeacherFormat:
    """Renders a rollout for a teacher with its own chat template and/or tokenizer.

    ``renderer`` renders prompts for the teacher (its template, its tokenizer);
    ``student_tokenizer`` decodes the student's completion; ``cross_tokenizer`` says the
    token ids differ and the completion text must be re-tokenized; ``character_topk`` is how
    many of the teacher's likely tokens to ask for to split its tokens over characters.
    """

    def __init__(
        self,
        renderer: ChatRenderer,
        student_tokenizer,
        student_stop_ids: list[int],
        cross_tokenizer: bool,
        *,
        character_topk: int = 0,
    ):
        self.renderer = renderer
        self.character_topk = character_topk
        self.student_tokenizer = student_tokenizer
        self.student_stop_ids = set(student_stop_ids)
        self.student_stop_id = student_stop_ids[0]
        self.cross_tokenizer = cross_tokenizer
        self._vocabulary: StudentVocabulary | None = None
        self._token_texts = TokenTexts(renderer.tokenizer)
        # the teacher's special tokens other than its end of turn: no text the student could write
        self._unwritten = set(renderer.tokenizer.all_special_ids) - set(renderer.stop_token_ids)

    def token_text(self, token_id: int) -> str:
        """A teacher token's text as it reads inside a text (decoded after another token, so that
        a tokenizer that drops a leading space at the start of a text keeps it)."""
        return self._token_texts(token_id)

    def build(
        self, messages, completion_ids: list[int], trajectory: Trajectory | None = None
    ) -> TeacherInput:
        """The teacher's token ids for the prompt and the completion, the student's turns marked.

        An episode (``trajectory``) is re-rendered turn by turn: the environment's replies in the
        teacher's own template between the student's turns, and never scored.
        """
        spans = turn_spans(trajectory, len(completion_ids))
        token_ids = self.renderer.prompt_ids(messages)
        score_mask = [False] * len(token_ids)
        history, turns = list(messages), []
        for index, (start, end) in enumerate(spans):
            body, piece = self._turn(completion_ids[start:end], len(token_ids))
            token_ids += body
            score_mask += [True] * len(body)
            turns.append(piece)
            if index + 1 < len(spans):
                replies = trajectory.replies[index]
                reply = self.renderer.reply_ids(history, body, replies)
                text = self.student_tokenizer.decode(
                    completion_ids[start:end], skip_special_tokens=True
                )
                history += [{"role": "assistant", "content": text}, *replies]
                token_ids += reply
                score_mask += [False] * len(reply)
        return TeacherInput(token_ids, score_mask, turns)

    def _turn(self, turn_ids: list[int], start: int) -> tuple[list[int], TurnPiece]:
        """A student turn in the teacher's tokens (its end of turn the teacher's), and its piece."""
        ends_with_stop = bool(turn_ids) and turn_ids[-1] in self.student_stop_ids
        teacher_stop = self.renderer.stop_token_ids[0]
        if not self.cross_tokenizer:
            body = [*turn_ids[:-1], teacher_stop] if ends_with_stop else list(turn_ids)
            return body, TurnPiece(start, len(body))
        body_ids = turn_ids[:-1] if ends_with_stop else turn_ids
        text = self.student_tokenizer.decode(body_ids)
        teacher_body, teacher_offsets = [], []
        if text:
            encoded = self.renderer.tokenizer(
                text, add_special_tokens=False, return_offsets_mapping=True
            )
            teacher_body, teacher_offsets = (
                list(encoded["input_ids"]),
                list(encoded["offset_mapping"]),
            )
        body = [*teacher_body, teacher_stop] if ends_with_stop else teacher_body
        piece = TurnPiece(
            start,
            len(body),
            text,
            teacher_offsets,
            token_char_ends(self.student_tokenizer, body_ids),
            ends_with_stop,
        )
        return body, piece

    def student_view(
        self,
        built: TeacherInput,
        piece: TurnPiece,
        teacher_logprobs: list[float],
        student_logprobs: list[float],
        teacher_topk: list[list[tuple[int, float]]] | None = None,
    ) -> list[float]:
        """Teacher log-probs per student token of one turn, from the teacher's answer at that turn's
        positions (``teacher_topk``: its likely tokens and their log-probs there; without them a
        teacher token's characters share its log-prob evenly)."""
        if piece.text is None:
            return teacher_logprobs
        body_ids = built.token_ids[piece.start : piece.start + piece.length]
        alternatives = []
        for position, (start, end) in enumerate(piece.teacher_offsets):
            own = body_ids[position]
            if teacher_topk is None or self.token_text(own) != piece.text[start:end]:
                alternatives.append(None)
                continue
            others = [(self.token_text(i), lp) for i, lp in teacher_topk[position] if i != own]
            alternatives.append(others)
        count = len(piece.teacher_offsets)
        chars, end_logprob = character_logprobs(
            piece.text, piece.teacher_offsets, teacher_logprobs[:count], alternatives
        )
        students = len(piece.student_ends)
        view = student_token_logprobs(chars, piece.student_ends, student_logprobs[:students])
        return [*view, end_logprob + teacher_logprobs[count]] if piece.ends_with_stop else view

    def student_next_tokens(
        self,
        built: TeacherInput,
        piece: TurnPiece,
        teacher_logprobs: list[float],
        teacher_topk: list[list[tuple[int, float]]],
        turn_ids: list[int],
        view: list[float],
        k: int,
    ) -> list[tuple[list[int], list[float]]]:
        """The teacher's top-``k`` over the student's tokens at each token of one turn
        (:mod:`opd.teachers.next_tokens`). Where its likely tokens cannot be read (a token that is
        not its text's, a character it does not cover), the student's own token with ``view``'s
        log-prob (the teacher's per student token) stands alone."""
        if self._vocabulary is None:
            self._vocabulary = StudentVocabulary(self.student_tokenizer, self.student_stop_id)
        vocabulary, text, offsets = self._vocabulary, piece.text, piece.teacher_offsets
        body_ids = built.token_ids[piece.start : piece.start + piece.length]
        steps = [
            TeacherStep(
                start,
                end,
                teacher_logprobs[p],
                self._candidates(
                    body_ids[p], teacher_logprobs[p], teacher_topk[p], text[start:end]
                ),
            )
            for p, (start, end) in enumerate(offsets)
        ]
        if piece.ends_with_stop:  # the end of turn is read after the text, a way from its end on
            p, stop = len(offsets), body_ids[len(offsets)]
            own = self.token_text(stop)
            candidates = self._candidates(stop, teacher_logprobs[p], teacher_topk[p], own)
            steps.append(TeacherStep(len(text), len(text) + 1, teacher_logprobs[p], candidates))
        reading = TeacherReading(text, steps)
        turn_ends = [*piece.student_ends, len(text) + 1][
            : len(piece.student_ends) + piece.ends_with_stop
        ]
        rows, start = [], 0
        for j, end in enumerate(turn_ends):
            row = student_topk(reading.ways(start), vocabulary, k) if end > start else None
            rows.append(row or pad_topk([turn_ids[j]], [view[j]], k, vocabulary.size))
            start = max(start, end)
        return rows

    def _candidates(
        self, own: int, logprob: float, topk: list[tuple[int, float]], text: str
    ) -> list[Candidate] | None:
        """The teacher's likely tokens at a position, its own first (None where its own token does
        not read as ``text``, the characters it covers), less special tokens that are not its end
        of turn."""
        if self.token_text(own) != text:
            return None
        stops = self.renderer.stop_token_ids
        return [Candidate(own, text, logprob, own in stops)] + [
            Candidate(token_id, self.token_text(token_id), lp, token_id in stops)
            for token_id, lp in topk
            if token_id != own and token_id not in self._unwritten
        ]
