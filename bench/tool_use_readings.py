"""How the tool-use bench's BPE teacher reads a character-level student's turns, next to how its
character-level twin (same recipe, same episodes) reads them.

opd turns the BPE teacher's likely tokens into a distribution over the student's next character
(``topk_forward_kl`` with ``cross_tokenizer``). Where that distribution is far from the one the
character teacher gives on the same text, the BPE teacher is judging the text differently, not
opd's reading of it: both teachers were trained on the same right episodes only, and differ in
how they carry on after a wrong character. ``disagreement`` measures it on a student's own
sampled turns (the call, and the answer after the right result), the text that on-policy
distillation trains on.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from opd.data.prompts import Prompt
from opd.data.render import ChatRenderer
from opd.demo.char_tokenizer import build_char_tokenizer
from opd.models import load_causal_lm, load_tokenizer
from opd.teachers.alignment import TeacherFormat
from opd.teachers.base import TeacherInput, TeacherRequest
from opd.teachers.local import LocalTeacher

TOPK = 20
FAR_NATS = 1.0
"""A character's two readings are called far apart above this KL (nats)."""
STUDENT_STOP_ID = 2
"""The character tokenizer's end of turn."""


@dataclass
class Reading:
    """A turn's characters (and end of turn) in student ids, and each position's next-character
    distribution as ``{student id: log-prob}``."""

    ids: list[int]
    next_characters: list[dict[int, float]]
    per_character: list[float]
    """The teacher's log-prob of each character the turn has (the per-character split)."""
    teacher_tokens: list[str]
    """The turn as the teacher's tokenizer cut it."""


class Teacher:
    """A cached tool-use teacher that reads a student's turn in the student's characters."""

    def __init__(self, directory: Path):
        tokenizer = load_tokenizer(str(directory), "teacher")
        self.char = build_char_tokenizer()
        self.cross_tokenizer = len(tokenizer) != len(self.char)
        self.format = TeacherFormat(
            ChatRenderer(tokenizer),
            self.char,
            [STUDENT_STOP_ID],
            cross_tokenizer=self.cross_tokenizer,
            character_topk=TOPK,
        )
        model = load_causal_lm(str(directory), "teacher", dtype="float32", device="cpu")
        self.model = LocalTeacher(model, vocab_size=len(tokenizer), pad_id=0)

    def read(self, messages, text: str) -> Reading:
        ids = self.char(text, add_special_tokens=False)["input_ids"] + [STUDENT_STOP_ID]
        built = self.format.build(messages, ids)
        (piece,) = built.turns
        answer = self.model.score(
            TeacherInput.from_sequences([built.token_ids], [built.score_mask], 0),
            TeacherRequest(topk=TOPK),
        )
        span = slice(piece.start, piece.start + piece.length)
        pieces = [self.format.token_text(token) for token in built.token_ids[span]]
        topk_ids, topk_logprobs = (
            answer.topk_ids_BTK[0, span].tolist(),
            answer.topk_logprobs_BTK[0, span].tolist(),
        )
        if not self.cross_tokenizer:  # the teacher's positions are the student's characters
            rows = [
                dict(zip(i, lp, strict=True)) for i, lp in zip(topk_ids, topk_logprobs, strict=True)
            ]
            return Reading(ids, rows, answer.logprobs_BT[0, span].tolist(), pieces)
        topk = [
            list(zip(i, lp, strict=True)) for i, lp in zip(topk_ids, topk_logprobs, strict=True)
        ]
        logprobs = answer.logprobs_BT[0, span].tolist()
        view = self.format.student_view(built, piece, logprobs, [0.0] * len(ids), topk)
        rows = self.format.student_next_tokens(built, piece, logprobs, topk, ids, view, TOPK)
        return Reading(ids, [dict(zip(i, lp, strict=True)) for i, lp in rows], view, pieces)


def kl(reference: dict[int, float], other: dict[int, float]) -> float:
    """KL(reference || other) over the reference's likely characters; a character the other
    gives no mass is charged as 30 nats (about e^-30)."""
    return sum(
        math.exp(lp) * (lp - max(other.get(i, -30.0), -30.0))
        for i, lp in reference.items()
        if lp > -20
    )


def disagreement(
    student_dir: Path, bpe: Teacher, char: Teacher, turns: list[tuple[str, tuple, str]], seed: int
) -> dict:
    """Each turn (kind, messages, right text): the student samples it once at temperature 1; both
    teachers read the sample. Per kind: the share of the student's turns that are right, and of
    their characters whose two readings are more than ``FAR_NATS`` apart, and the median KL."""
    student = load_causal_lm(str(student_dir), "student", dtype="float32", device="cpu")
    renderer = ChatRenderer(char.char)
    generator = torch.Generator().manual_seed(seed)
    found: dict[str, dict] = {}
    for kind, messages, right in turns:
        prompt_ids = renderer.prompt_ids(messages)
        torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=generator)))
        out = student.generate(
            torch.tensor([prompt_ids]),
            do_sample=True,
            temperature=1.0,
            max_new_tokens=32,
            eos_token_id=STUDENT_STOP_ID,
            pad_token_id=0,
        )
        turn = out[0, len(prompt_ids) :].tolist()
        text = char.char.decode(
            turn[: turn.index(STUDENT_STOP_ID)] if STUDENT_STOP_ID in turn else turn
        )
        by_bpe, by_char = bpe.read(messages, text), char.read(messages, text)
        gaps = [
            kl(c, b) for c, b in zip(by_char.next_characters, by_bpe.next_characters, strict=True)
        ]
        entry = found.setdefault(kind, {"turns": 0, "right": 0, "gaps": []})
        entry["turns"] += 1
        entry["right"] += text == right
        entry["gaps"] += gaps
    return {
        kind: {
            "turns": entry["turns"],
            "right": entry["right"] / entry["turns"],
            "characters": len(entry["gaps"]),
            "far_apart": sum(gap > FAR_NATS for gap in entry["gaps"]) / len(entry["gaps"]),
            "median_kl": sorted(entry["gaps"])[len(entry["gaps"]) // 2],
        }
        for kind, entry in found.items()
    }


def labelled(turns: list[Prompt]) -> list[tuple[str, tuple, str]]:
    """The teacher's supervised turns (a call, then the answer after the right result, per
    prompt) as (kind, conversation before the turn, the turn's text)."""
    kinds = ("call", "answer") * (len(turns) // 2)
    return [(kind, turn.messages, turn.completion) for kind, turn in zip(kinds, turns, strict=True)]
