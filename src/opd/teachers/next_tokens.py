"""A teacher with another tokenizer as a top-k over the *student's* next tokens.

The teacher scores the sampled text in its own tokens and sends its likely tokens at each
position (its own and the top ``character_topk``). After ``text[:at]`` the text may go on along
any likely token of a position at or before ``at`` whose text agrees with the text from there
to ``at`` and goes on past it: its mass is the teacher's own tokens' up to that position times
its own. So where the student's text still agrees with a long token the teacher would have
written from an earlier position (its ``<calc>8`` when the student's text, cut otherwise later
on, reads ``<ca``), that token says how it goes on, not only the token the teacher's tokenizer
happened to cut there. With one position back this is the per-character split of
:func:`opd.teachers.alignment.character_logprobs`.

Each way is credited to the student token that writes its first characters: the teacher's end
of turn is the student's, any other way goes to the longest student token that is a prefix of
it, and the masses of one student token add up. A character-level student so gets the teacher's
next-character distribution, a student whose tokens match the teacher's gets its own top-k.
What no way places (a continuation no student token starts, a likely token that ends exactly at
``at``, what is below the top-k) is not known to fall outside the student tokens the ways reach,
so those get shares of the mass the ways place: the tail is only what lies beyond the student's
``k`` (a tail of unknown mass would tell the student to spread its own over every other token
wherever the teacher is unsure). Approximations: paths through the teacher's other tokens than
its own (and their likely tokens) are not known and not counted; a longer student token is
scored by the teacher's token it starts.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from dataclasses import dataclass

PAD_LOGPROB = -1.0e4
"""The log-prob of padding entries of a top-k row: a zero mass that keeps ``0 * log`` finite."""


@dataclass(frozen=True)
class Candidate:
    """One of the teacher's likely tokens at a position: its id, its text and its log-prob."""

    token_id: int
    text: str
    logprob: float
    ends_turn: bool = False
    """The teacher's end of turn: a way only where it is sent, never read as its text."""


class TokenTexts:
    """A tokenizer's token texts as they read inside a text: decoded after another token, so that
    a tokenizer that drops a leading space at the start of a text keeps it (cached)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._anchor = tokenizer("a", add_special_tokens=False)["input_ids"]
        self._anchor_length = len(tokenizer.decode(self._anchor))
        self._texts: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        if token_id not in self._texts:
            self._texts[token_id] = self.tokenizer.decode([*self._anchor, token_id])[
                self._anchor_length :
            ]
        return self._texts[token_id]


class StudentVocabulary:
    """The student's token for a text going on: its end of turn, or its longest token that is a
    prefix of the text."""

    def __init__(self, tokenizer, stop_id: int):
        self.stop_id = stop_id
        special, token_text = set(tokenizer.all_special_ids), TokenTexts(tokenizer)
        self.ids: dict[str, int] = {}
        for token_id in range(len(tokenizer)):
            if token_id in special:
                continue
            text = token_text(token_id)
            if text and "\ufffd" not in text:
                self.ids.setdefault(text, token_id)
        self.longest = max((len(text) for text in self.ids), default=0)
        self.size = len(tokenizer)

    def writing(self, text: str) -> int | None:
        """The student token that starts ``text`` (None: none does)."""
        for length in range(min(len(text), self.longest), 0, -1):
            token_id = self.ids.get(text[:length])
            if token_id is not None:
                return token_id
        return None


@dataclass(frozen=True)
class TeacherStep:
    """One of the teacher's tokens of the sampled text: the characters it covers, its log-prob and
    its likely tokens there, its own first (None where they cannot be read against the text)."""

    start: int
    end: int
    logprob: float
    candidates: list[Candidate] | None


class TeacherReading:
    """The teacher's tokens of one turn, read for the ways the text may go on at each character."""

    def __init__(self, text: str, steps: list[TeacherStep]):
        self.text, self.steps = text, steps
        self.starts = [step.start for step in steps]
        # the log-prob of the teacher's own tokens before each step: the path that reaches it
        self.before: list[float] = []
        total = 0.0
        for step in steps:
            self.before.append(total)
            total += step.logprob
        self.longest = max((len(c.text) for s in steps for c in s.candidates or []), default=0)

    def ways(self, at: int) -> list[tuple[Candidate, str, float]]:
        """The ways the text may go on after ``text[:at]``: ``(candidate, rest, logprob)``, a likely
        token of a teacher position at or before ``at`` whose text agrees with the text from that
        position to ``at`` and goes on past it (``rest``: what it writes from ``at`` on), with the
        log-prob of reaching that position along the teacher's own tokens and choosing it. The
        teacher's own token there is a way only if it ends past ``at`` (else the next position's
        tokens go on from it)."""
        found = []
        first = bisect_left(
            self.starts, at - self.longest + 1
        )  # no likely token reaches past from before
        for step, before in zip(self.steps[first:], self.before[first:], strict=True):
            if step.start > at:
                break
            if step.candidates is None:
                continue
            prefix = self.text[step.start : at]
            for n, candidate in enumerate(step.candidates):
                if (n == 0 and step.end <= at) or (candidate.ends_turn and prefix):
                    continue
                if candidate.ends_turn:
                    found.append((candidate, "", before + candidate.logprob))
                    continue
                if len(candidate.text) > len(prefix) and candidate.text.startswith(prefix):
                    found.append(
                        (candidate, candidate.text[len(prefix) :], before + candidate.logprob)
                    )
        return found


def student_topk(
    ways: list[tuple[Candidate, str, float]], vocabulary: StudentVocabulary, k: int
) -> tuple[list[int], list[float]] | None:
    """The ``k`` student tokens the ways going on start with the most mass, as shares of the mass
    every way that a student token starts places, padded to ``k`` (None: no way places any)."""
    masses: dict[int, list[float]] = {}
    for candidate, rest, logprob in ways:
        token_id = vocabulary.stop_id if candidate.ends_turn else vocabulary.writing(rest)
        if token_id is not None:
            masses.setdefault(token_id, []).append(logprob)
    if not masses:
        return None
    placed = logsumexp([lp for values in masses.values() for lp in values])
    ranked = sorted(((logsumexp(v) - placed, i) for i, v in masses.items()), reverse=True)[:k]
    return pad_topk([i for _, i in ranked], [lp for lp, _ in ranked], k, vocabulary.size)


def pad_topk(
    ids: list[int], logprobs: list[float], k: int, vocab_size: int
) -> tuple[list[int], list[float]]:
    """``ids`` and ``logprobs`` filled to ``k`` with other ids of no mass (each its own bucket)."""
    ids, logprobs = list(ids), [min(lp, 0.0) for lp in logprobs]
    used, spare = set(ids), iter(range(vocab_size))
    while len(ids) < k:
        token_id = next(spare)
        if token_id not in used:
            ids.append(token_id)
            logprobs.append(PAD_LOGPROB)
    return ids, logprobs


def logsumexp(values: list[float]) -> float:
    """log(sum(exp(values))) of a few Python floats, without overflow."""
    top = max(values)
    return top + math.log(sum(math.exp(value - top) for value in values))
