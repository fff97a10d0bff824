"""Showing the teacher the student's completion in the teacher's own format and tokens.

Two mismatches are handled:

- **Chat template** (same tokenizer): the prompt is rendered with the teacher's template and
  the student's completion ids follow unchanged (the student's end-of-turn token becomes the
  teacher's), so completion positions map one to one.
- **Tokenizer**: the completion *text* is tokenized by the teacher. Both token sequences are
  cut at the character offsets where both have a token boundary; each piece between two
  shared boundaries is a *span*. A span's teacher log-prob is the sum over its teacher
  tokens, its student log-prob the sum over its student tokens (the probability of the
  same text under each model, given the same preceding text). The span's reverse KL is
  spread evenly over its student tokens, so per-span totals (and ``teacher_kl``) are exact,
  and a span of one token on each side reduces to the direct per-token computation.

Approximation: the teacher scores the student's text under its own tokenization of it,
which need not be the tokenization the teacher would have sampled; and a span's KL is
shared equally by its student tokens. Characters the teacher's tokenizer cannot encode
(dropped, so no teacher token covers them) are text the teacher cannot produce: each costs
``UNCOVERED_CHAR_LOGPROB`` nats in its span, so the student is never rewarded for them.
"""

from __future__ import annotations

from dataclasses import dataclass

from opd.data.render import ChatRenderer

UNCOVERED_CHAR_LOGPROB = -20.0


def token_char_ends(tokenizer, token_ids: list[int]) -> list[int]:
    """Character offset, in ``decode(token_ids)``, where each token's text ends."""
    ends, previous = [], 0
    for count in range(1, len(token_ids) + 1):
        length = len(tokenizer.decode(token_ids[:count]))
        previous = max(previous, length)
        ends.append(previous)
    return ends


def align_spans(student_ends: list[int], teacher_ends: list[int]) -> tuple[list[int], list[int]]:
    """Span index of every student token and every teacher token.

    Spans close where both sequences have a token ending at the same character offset; the
    last span closes at the end of the text whatever the offsets say.
    """
    shared = set(student_ends) & set(teacher_ends)
    total = max(student_ends[-1] if student_ends else 0, teacher_ends[-1] if teacher_ends else 0)
    shared.add(total)

    def spans(ends: list[int]) -> list[int]:
        span, out = 0, []
        for position, end in enumerate(ends):
            out.append(span)
            if end in shared or position == len(ends) - 1:
                span += 1
        return out

    student, teacher = spans(student_ends), spans(teacher_ends)
    if student and teacher and student[-1] != teacher[-1]:
        last = min(student[-1], teacher[-1])
        student = [min(s, last) for s in student]
        teacher = [min(t, last) for t in teacher]
    return student, teacher


def spread_span_logprobs(
    student_logprobs: list[float],
    student_spans: list[int],
    teacher_logprobs: list[float],
    teacher_spans: list[int],
    span_penalties: dict[int, float] | None = None,
) -> list[float]:
    """A teacher log-prob per student token: ``lp_i - KL(span) / |span|``, KL(span) = sum lp - sum lq.

    ``span_penalties`` adds log-probability (negative) to a span's teacher sum.
    """
    span_student: dict[int, float] = {}
    span_teacher: dict[int, float] = dict(span_penalties or {})
    span_size: dict[int, int] = {}
    for value, span in zip(student_logprobs, student_spans, strict=True):
        span_student[span] = span_student.get(span, 0.0) + value
        span_size[span] = span_size.get(span, 0) + 1
    for value, span in zip(teacher_logprobs, teacher_spans, strict=True):
        span_teacher[span] = span_teacher.get(span, 0.0) + value
    return [
        value - (span_student[span] - span_teacher.get(span, 0.0)) / span_size[span]
        for value, span in zip(student_logprobs, student_spans, strict=True)
    ]


def uncovered_penalties(
    text: str, student_ends: list[int], student_spans: list[int], teacher_offsets: list[tuple[int, int]]
) -> dict[int, float]:
    """Per span, ``UNCOVERED_CHAR_LOGPROB`` times the characters of it that no teacher token covers."""
    covered = [False] * len(text)
    for start, end in teacher_offsets:
        for position in range(start, min(end, len(text))):
            covered[position] = True
    penalties: dict[int, float] = {}
    start = 0
    for end, span in zip(student_ends, student_spans, strict=True):
        missing = sum(not c for c in covered[start:end])
        if missing:
            penalties[span] = penalties.get(span, 0.0) + UNCOVERED_CHAR_LOGPROB * missing
        start = end
    return penalties


@dataclass
class TeacherInput:
    """What the teacher scores for one rollout, and how to map its answer back."""

    token_ids: list[int]
    score_mask: list[bool]
    completion_start: int
    student_spans: list[int] | None = None
    teacher_spans: list[int] | None = None
    span_penalties: dict[int, float] | None = None


class TeacherFormat:
    """Renders a rollout for a teacher with its own chat template and/or tokenizer.

    ``renderer`` renders prompts for the teacher (its template, its tokenizer);
    ``student_tokenizer`` decodes the student's completion; ``cross_tokenizer`` says the
    token ids differ and the completion text must be re-tokenized.
    """

    def __init__(
        self, renderer: ChatRenderer, student_tokenizer, student_stop_ids: list[int], cross_tokenizer: bool
    ):
        self.renderer = renderer
        self.student_tokenizer = student_tokenizer
        self.student_stop_ids = set(student_stop_ids)
        self.cross_tokenizer = cross_tokenizer

    def build(self, messages, completion_ids: list[int]) -> TeacherInput:
        """The teacher's token ids for prompt + completion, with the completion positions marked."""
        prompt_ids = self.renderer.prompt_ids(messages)
        ends_with_stop = bool(completion_ids) and completion_ids[-1] in self.student_stop_ids
        teacher_stop = self.renderer.stop_token_ids[0]
        if not self.cross_tokenizer:
            body = [*completion_ids[:-1], teacher_stop] if ends_with_stop else list(completion_ids)
            return self._input(prompt_ids, body)
        body_ids = completion_ids[:-1] if ends_with_stop else completion_ids
        text = self.student_tokenizer.decode(body_ids)
        teacher_body, teacher_offsets = [], []
        if text:
            encoded = self.renderer.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
            teacher_body, teacher_offsets = list(encoded["input_ids"]), list(encoded["offset_mapping"])
        student_ends = token_char_ends(self.student_tokenizer, body_ids)
        student_spans, teacher_spans = align_spans(student_ends, [end for _, end in teacher_offsets])
        penalties = uncovered_penalties(text, student_ends, student_spans, teacher_offsets)
        if ends_with_stop:  # the end of turn is its own span on both sides
            last = max(student_spans + teacher_spans, default=-1) + 1
            student_spans, teacher_spans = [*student_spans, last], [*teacher_spans, last]
            teacher_body = [*teacher_body, teacher_stop]
        built = self._input(prompt_ids, teacher_body)
        built.student_spans, built.teacher_spans, built.span_penalties = (
            student_spans,
            teacher_spans,
            penalties,
        )
        return built

    @staticmethod
    def _input(prompt_ids: list[int], body: list[int]) -> TeacherInput:
        ids = prompt_ids + body
        mask = [False] * len(prompt_ids) + [True] * len(body)
        return TeacherInput(ids, mask, len(prompt_ids))

    def student_view(
        self, built: TeacherInput, teacher_logprobs: list[float], student_logprobs: list[float]
    ) -> list[float]:
        """Teacher log-probs per student completion token, from the teacher's per-position answer."""
        if built.student_spans is None:
            return teacher_logprobs
        return spread_span_logprobs(
            student_logprobs, built.student_spans, teacher_logprobs, built.teacher_spans, built.span_penalties
        )
