"""The teacher writing completions for the student to learn from (``data_source: teacher``, and
``mixed``'s teacher steps): in process or on a server, in the student's format or its own.

A teacher that reads the student's tokens and template samples the student's prompt ids and
its completion is used as it is. One with its own chat template samples the conversation as
its template renders it; one with its own tokenizer too, and its text is then tokenized by the
student. Either way the student gets its own token ids, its own end of turn where the teacher
ended its turn, and a completion cut at ``max_tokens`` of its tokens is marked unfinished. In an
episode the same holds turn by turn: each turn the teacher answers the whole conversation so
far, the environment's replies included. A teacher shown a privileged context writes after it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

from opd.data.prompts import Prompt
from opd.data.sequences import Completion
from opd.sampling.base import SamplingParams
from opd.teachers.alignment import TeacherFormat
from opd.teachers.base import rows_by_identity
from opd.teachers.context import PrivilegedContext

TeacherSample = Callable[[list[list[int]], float, int, list[int]], list[Completion]]
"""``(prompt ids, temperature, max_tokens, seeds)``: one completion per prompt, in the teacher's
ids."""


class TeacherWriter:
    """Completions of a teacher in the student's token ids.

    ``sample`` draws in the teacher's own ids from prompts in them (stopping where the teacher's
    turns end); ``teacher_format`` says how the teacher reads a conversation (None: as the
    student, same ids); ``student_tokenizer`` and ``student_stop_ids`` write its text as the
    student's tokens.
    """

    def __init__(
        self,
        sample: TeacherSample,
        teacher_format: TeacherFormat | None,
        student_tokenizer,
        student_stop_ids: list[int],
        context: PrivilegedContext | None = None,
    ):
        self.sample = sample
        self.format = teacher_format
        self.context = context
        """What the teacher is shown before each conversation (a context needs a format)."""
        self.student_tokenizer = student_tokenizer
        self.student_stop = student_stop_ids[0]

    def write(
        self,
        prompts: list[list[int]],
        conversations: Sequence[Sequence[dict[str, str]]],
        params: SamplingParams,
        seeds: list[int],
        records: Sequence[Prompt],
    ) -> list[Completion]:
        """One completion per row: ``prompts`` are the rows in the student's ids, ``conversations``
        the same rows as messages (what a teacher with its own format renders), ``records`` each
        row's prompt (the fields its privileged context reads)."""
        if self.format is None:
            return self.sample(prompts, params.temperature, params.max_tokens, seeds)
        if self.context is not None:
            conversations = [
                self.context.messages(replace(record, messages=tuple(messages)))
                for messages, record in zip(conversations, records, strict=True)
            ]
        rendered = [self.format.renderer.prompt_ids(list(messages)) for messages in conversations]
        written = self.sample(rendered, params.temperature, params.max_tokens, seeds)
        return [self.in_student_ids(completion, params.max_tokens) for completion in written]

    def in_student_ids(self, completion: Completion, max_tokens: int) -> Completion:
        """A completion in the teacher's ids as the student's: its body (re-tokenized when the
        tokenizers differ), then the student's end of turn if the teacher ended its turn."""
        ids = completion.token_ids
        ended_turn = (
            completion.finished and bool(ids) and ids[-1] in self.format.renderer.stop_token_ids
        )
        body = ids[:-1] if ended_turn else ids
        if self.format.cross_tokenizer:
            text = self.format.renderer.tokenizer.decode(body)
            token_ids = list(self.student_tokenizer(text, add_special_tokens=False)["input_ids"])
            logprobs = [0.0] * len(token_ids)  # the teacher's are of its own tokens: none of these
        else:
            token_ids, logprobs = list(body), list(completion.logprobs[: len(body)])
        if ended_turn:
            token_ids.append(self.student_stop)
            logprobs.append(completion.logprobs[-1] if not self.format.cross_tokenizer else 0.0)
        finished = completion.finished and len(token_ids) <= max_tokens
        return Completion(token_ids[:max_tokens], logprobs[:max_tokens], finished=finished)


def write_rows(
    writers: Sequence[TeacherWriter],
    prompts: list[list[int]],
    conversations: Sequence[Sequence[dict[str, str]]],
    params: SamplingParams,
    seeds: list[int],
    records: Sequence[Prompt],
) -> list[Completion]:
    """Each row's completion by its own writer (``writers[row]``, its dataset's teacher), in row
    order; a writer gets all of its rows in one call, so a teacher decodes them together."""
    completions: list[Completion] = [None] * len(prompts)
    for rows in rows_by_identity(writers):
        written = writers[rows[0]].write(
            [prompts[r] for r in rows],
            [conversations[r] for r in rows],
            params,
            [seeds[r] for r in rows],
            [records[r] for r in rows],
        )
        for row, completion in zip(rows, written, strict=True):
            completions[row] = completion
    return completions
