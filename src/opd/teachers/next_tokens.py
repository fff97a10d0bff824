"""A teacher with another tokenizer as a top-k over the *student's* next tokens.

The teacher's likely tokens at a position (its own and the top ``character_topk``) say how the
text goes on; where a student token starts, the teacher's chance of each way to go on is mapped
onto the student token that writes its first characters:

- mid teacher token (the student token starts at ``text[a:c]`` inside a teacher token covering
  ``text[a:b]``): the teacher's likely tokens that start with ``text[a:c]`` and go on past it, each
  with its probability given that prefix;
- at a teacher token's start: that position's likely tokens, times the chance that the token
  before ended there, plus the token before's longer alternatives that go on past it (as
  :func:`opd.teachers.alignment.character_logprobs` splits the sampled text);
- the teacher's end of turn is the student's; any other way to go on is written by the longest
  student token that is a prefix of it, and the masses of one student token add up.

So a character-level student gets the teacher's next-character distribution, and a student
whose tokens match the teacher's gets the teacher's own top-k (the exact-match mapping). What
falls outside (a continuation no student token starts, a teacher token that ends exactly where
the student's starts, what is below the top-k) is not known to fall outside the student tokens
the rest reaches, so those are given the teacher's mass *among the ways they place*: the tail is
only what lies beyond the student's ``k`` (a tail of unknown mass would tell the student to
spread its own over every other token wherever the teacher is unsure). Approximation: a longer
student token is scored by the teacher's token it starts, not by the teacher's path through
several.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

PAD_LOGPROB = -1.0e4
"""The log-prob of padding entries of a top-k row: a zero mass that keeps ``0 * log`` finite."""


@dataclass(frozen=True)
class Candidate:
    """One of the teacher's likely tokens at a position: its id, its text and its log-prob."""

    token_id: int
    text: str
    logprob: float


class StudentVocabulary:
    """The student's token for a text going on: its end of turn, or its longest token that is a
    prefix of the text."""

    def __init__(self, tokenizer, stop_id: int):
        self.stop_id = stop_id
        special = set(tokenizer.all_special_ids)
        anchor = tokenizer("a", add_special_tokens=False)["input_ids"]
        anchor_length = len(tokenizer.decode(anchor))
        self.ids: dict[str, int] = {}
        for token_id in range(len(tokenizer)):
            if token_id in special:
                continue
            text = tokenizer.decode([*anchor, token_id])[anchor_length:]
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


def going_on(
    text: str, start: int, at: int, candidates: list[Candidate], previous: tuple[str, list[Candidate]] | None
) -> list[tuple[Candidate | None, str, float]]:
    """The ways the text may go on at character ``at``, inside or at the start (``at == start``) of a
    teacher token starting at ``start`` whose likely tokens are ``candidates``.

    Returns ``(candidate, rest, logprob)``: the teacher token it comes from (None: the end of turn is
    not one), the text it writes from ``at`` on, and its log-prob given ``text[:at]``. ``previous``:
    the text and likely tokens of the teacher token ending at ``at`` (a token start only), whose
    longer alternatives also go on past it.
    """
    prefix = text[start:at]
    if at > start:
        kept = [c for c in candidates if c.text.startswith(prefix)]
        if not kept:
            return []
        mass = _logsumexp([c.logprob for c in kept])
        return [(c, c.text[len(prefix) :], c.logprob - mass) for c in kept if len(c.text) > len(prefix)]
    if previous is None:
        return [(c, c.text, c.logprob) for c in candidates]
    token, before = previous
    along = [c for c in before if c.text.startswith(token)]
    mass = _logsumexp([c.logprob for c in along])
    ended = next(c.logprob for c in before if c.text == token) - mass
    ways = [(c, c.text, c.logprob + ended) for c in candidates]
    return ways + [(c, c.text[len(token) :], c.logprob - mass) for c in along if len(c.text) > len(token)]


def student_topk(
    ways: list[tuple[Candidate | None, str, float]],
    vocabulary: StudentVocabulary,
    teacher_stop_ids: set[int],
    k: int,
) -> tuple[list[int], list[float]]:
    """The ``k`` student tokens the ways going on start with the most mass, as shares of the mass
    every way that a student token starts places, padded to ``k``."""
    masses: dict[int, list[float]] = {}
    for candidate, rest, logprob in ways:
        if candidate is not None and candidate.token_id in teacher_stop_ids:
            token_id = vocabulary.stop_id
        else:
            token_id = vocabulary.writing(rest)
        if token_id is not None:
            masses.setdefault(token_id, []).append(logprob)
    if not masses:
        return pad_topk([], [], k, vocabulary.size)
    placed = _logsumexp([lp for values in masses.values() for lp in values])
    ranked = sorted(((_logsumexp(v) - placed, i) for i, v in masses.items()), reverse=True)[:k]
    return pad_topk([i for _, i in ranked], [lp for lp, _ in ranked], k, vocabulary.size)


def pad_topk(ids: list[int], logprobs: list[float], k: int, vocab_size: int) -> tuple[list[int], list[float]]:
    """``ids`` and ``logprobs`` filled to ``k`` with other ids of no mass (each its own bucket)."""
    ids, logprobs = list(ids), [min(lp, 0.0) for lp in logprobs]
    used, spare = set(ids), iter(range(vocab_size))
    while len(ids) < k:
        token_id = next(spare)
        if token_id not in used:
            ids.append(token_id)
            logprobs.append(PAD_LOGPROB)
    return ids, logprobs


def _logsumexp(values: list[float]) -> float:
    top = max(values)
    return top + math.log(sum(math.exp(value - top) for value in values))
