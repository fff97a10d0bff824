"""A teacher with another tokenizer read as a top-k over the student's next tokens: by hand, against
the per-character split of the sampled text, and in a training step."""

import itertools
import math
import random

import pytest
import torch

from opd.config import ConfigError, config_from_dict
from opd.data.render import ChatRenderer
from opd.demo.char_tokenizer import build_char_tokenizer
from opd.teachers.alignment import TeacherFormat, character_logprobs
from opd.teachers.next_tokens import (
    PAD_LOGPROB,
    Candidate,
    StudentVocabulary,
    TeacherReading,
    TeacherStep,
    student_topk,
)
from tests.test_alignment import bpe_tokenizer

CHARS = build_char_tokenizer()
STOP = 2


def masses(ways) -> dict[str, float]:
    """The probability of each student character the ways going on start with (a naive sum)."""
    out: dict[str, float] = {}
    for candidate, rest, logprob in ways:
        char = "<stop>" if candidate.ends_turn else rest[0]
        out[char] = out.get(char, 0.0) + math.exp(logprob)
    return out


def topk(ways, k=8) -> dict[str, float]:
    """The student's top-k as {text: probability}, padding left out."""
    ids, logprobs = student_topk(ways, StudentVocabulary(CHARS, STOP), k)
    return {
        ("<stop>" if i == STOP else CHARS.decode([i])): math.exp(lp)
        for i, lp in zip(ids, logprobs, strict=True)
        if lp > PAD_LOGPROB
    }


def candidates(pairs, first_id=10):
    return [Candidate(first_id + n, text, math.log(p)) for n, (text, p) in enumerate(pairs)]


def hand_reading() -> TeacherReading:
    """ "abc" as the teacher's "ab" (p 0.5) then "c" (p 0.9), then its end of turn (id 99, p 0.8),
    as in test_alignment's hand example; its other likely tokens: at "ab", "a" 0.1, "ax" 0.1, "abd"
    0.1, "abc" 0.05, "b" 0.1; at "c", "cd" 0.05; at the end of turn, "x" 0.1."""
    first = candidates(
        [("ab", 0.5), ("a", 0.1), ("ax", 0.1), ("abd", 0.1), ("abc", 0.05), ("b", 0.1)]
    )
    second = candidates([("c", 0.9), ("cd", 0.05)])
    end = [Candidate(99, "<|im_end|>", math.log(0.8), ends_turn=True), *candidates([("x", 0.1)])]
    steps = [
        TeacherStep(0, 2, math.log(0.5), first),
        TeacherStep(2, 3, math.log(0.9), second),
        TeacherStep(3, 4, math.log(0.8), end),
    ]
    return TeacherReading("abc", steps)


def test_the_next_characters_by_hand():
    reading = hand_reading()
    # before "a": every likely token's first character
    assert masses(reading.ways(0)) == pytest.approx({"a": 0.85, "b": 0.1})
    # after "a", inside "ab": the tokens starting with "a" that go on past it ("a" alone ends
    # there: what follows it is not known here)
    assert masses(reading.ways(1)) == pytest.approx({"b": 0.65, "x": 0.1})
    # after "ab": "abd" and "abc" go on, or "ab" (0.5) and then "c" or "cd"
    assert masses(reading.ways(2)) == pytest.approx({"c": 0.05 + 0.5 * 0.95, "d": 0.1})
    # after "abc": "ab", "c" (0.45) and then the end of turn or "x", or "ab" and "cd"
    assert masses(reading.ways(3)) == pytest.approx(
        {"<stop>": 0.45 * 0.8, "x": 0.45 * 0.1, "d": 0.5 * 0.05}
    )
    # the student's top-k: shares of the mass the ways place (0.43 here), the top 2 of them
    assert topk(reading.ways(3), 2) == pytest.approx({"<stop>": 0.36 / 0.43, "x": 0.045 / 0.43})
    assert topk(reading.ways(1)) == pytest.approx({"b": 0.65 / 0.75, "x": 0.1 / 0.75})


def test_a_long_token_from_further_back_says_how_the_text_goes_on():
    # "abcd" cut as "a" (0.01), "b" (0.5), "cd" (0.5), where the teacher would have written
    # "abcx" (0.9) from the start: after "abc" it says "x", not the "d" of the token it was cut into
    steps = [
        TeacherStep(0, 1, math.log(0.01), candidates([("a", 0.01), ("abcx", 0.9)])),
        TeacherStep(1, 2, math.log(0.5), candidates([("b", 0.5)])),
        TeacherStep(2, 4, math.log(0.5), candidates([("cd", 0.5)])),
    ]
    reading = TeacherReading("abcd", steps)
    assert masses(reading.ways(3)) == pytest.approx({"x": 0.9, "d": 0.01 * 0.5 * 0.5})
    assert masses(reading.ways(1)) == pytest.approx({"b": 0.9 + 0.01 * 0.5})


def test_a_student_token_gets_the_mass_of_every_way_it_starts():
    # a student whose tokens are longer than one character: each way goes to the student's longest
    # token that starts it, and a way that no student token starts is the tail
    tokenizer = bpe_tokenizer()
    word = next(t for t in tokenizer.get_vocab() if len(t) >= 2 and t.isalpha())
    word_id, letter_id = tokenizer.convert_tokens_to_ids([word, word[0]])
    snowman = "\u2603"  # no token has it
    likely = candidates([(word, 0.5), (word + snowman, 0.1), (word[0], 0.2), (snowman, 0.1)])
    ways = TeacherReading(word, [TeacherStep(0, len(word), math.log(0.5), likely)]).ways(0)
    ids, logprobs = student_topk(ways, StudentVocabulary(tokenizer, 0), 4)
    got = {i: math.exp(lp) for i, lp in zip(ids, logprobs, strict=True) if lp > PAD_LOGPROB}
    assert got == pytest.approx(
        {word_id: 0.6 / 0.8, letter_id: 0.2 / 0.8}
    )  # the snowman places nothing
    assert len(set(ids)) == 4  # padded with distinct ids of no mass


def naive_next_characters(fmt, text, offsets, body, teacher, topk, at) -> dict[int, float]:
    """The definition, position by position: every likely token of a position at or before ``at``
    that agrees with the text up to ``at`` and goes on past it, reached along the teacher's own
    tokens; shares per next character (its student id), the end of turn the student's."""
    found: dict[int, float] = {}
    for p, token in enumerate(body):
        start, end = offsets[p] if p < len(offsets) else (len(text), len(text) + 1)
        if start > at:
            break
        reach = math.exp(sum(teacher[:p]))
        for other, logprob in [(token, teacher[p])] + [(i, lp) for i, lp in topk[p] if i != token]:
            if other == token and end <= at:
                continue
            if (
                other in fmt.renderer.stop_token_ids
            ):  # the end of turn goes on from where it is sent
                if at == start:
                    found[STOP] = found.get(STOP, 0.0) + reach * math.exp(logprob)
                continue
            if other in fmt.renderer.tokenizer.all_special_ids:
                continue
            written = fmt.token_text(other)
            if len(written) > at - start and written.startswith(text[start:at]):
                char = CHARS.convert_tokens_to_ids(written[at - start])
                found[char] = found.get(char, 0.0) + reach * math.exp(logprob)
    total = sum(found.values())
    return {char: mass / total for char, mass in found.items()}


def test_the_next_characters_of_random_text_follow_the_definition():
    """Over a BPE teacher's real cut of random text, with random likely tokens, each row is the
    definition computed naively, position by position, and places all the mass on distinct ids."""
    teacher_tokenizer = bpe_tokenizer()
    fmt = TeacherFormat(
        ChatRenderer(teacher_tokenizer), CHARS, [STOP], cross_tokenizer=True, character_topk=12
    )
    rng = random.Random(0)
    vocab = len(teacher_tokenizer)
    for trial in range(20):
        text = "".join(rng.choice("abcdefgh ") for _ in range(rng.randint(1, 14)))
        ids = CHARS(text, add_special_tokens=False)["input_ids"] + [STOP]
        built = fmt.build(({"role": "user", "content": "reverse abc"},), ids)
        (piece,) = built.turns
        width = piece.length
        topk, own_logprobs = [], []
        for _ in range(width):
            logits = (
                torch.randn(vocab, generator=torch.Generator().manual_seed(rng.randrange(10**6)))
                * 3
            )
            logprobs = torch.log_softmax(logits, -1)
            top = logprobs.topk(12)
            topk.append(list(zip(top.indices.tolist(), top.values.tolist(), strict=True)))
            own_logprobs.append(logprobs)
        body = built.token_ids[piece.start : piece.start + width]
        teacher = [float(own_logprobs[p][token]) for p, token in enumerate(body)]
        view = fmt.student_view(built, piece, teacher, [-1.0] * len(ids), topk)
        rows = fmt.student_next_tokens(built, piece, teacher, topk, ids, view, 32)
        assert len(rows) == len(ids)
        for j, (row_ids, row_logprobs) in enumerate(rows):
            assert len(set(row_ids)) == 32 and sum(
                math.exp(lp) for lp in row_logprobs
            ) == pytest.approx(1)
            got = {
                i: math.exp(lp)
                for i, lp in zip(row_ids, row_logprobs, strict=True)
                if lp > PAD_LOGPROB
            }
            naive = naive_next_characters(fmt, text, piece.teacher_offsets, body, teacher, topk, j)
            assert got == pytest.approx(naive, abs=1e-6), (trial, text, j)


def test_with_one_position_back_the_reading_is_the_per_character_split():
    first = [("a", 0.1), ("ax", 0.1), ("abd", 0.1), ("abc", 0.05), ("b", 0.1)]
    alternatives = [[(t, math.log(p)) for t, p in first], [("cd", math.log(0.05))]]
    chars, _ = character_logprobs(
        "abc", [(0, 2), (2, 3)], [math.log(0.5), math.log(0.9)], alternatives
    )
    reading = hand_reading()
    going_on = [1.0] + [masses(reading.ways(at))[char] for at, char in enumerate("abc")]
    # a character's log-prob: the mass going on with it over the mass going on with the one before
    assert [
        math.log(after / before) for before, after in itertools.pairwise(going_on)
    ] == pytest.approx(chars)


def test_the_top_k_with_a_cross_tokenizer_teacher_needs_its_likely_tokens(base_config):
    base_config["teacher"].update(cross_tokenizer=True, character_topk=0)
    base_config["training"]["objective"] = "topk_forward_kl"
    with pytest.raises(
        ConfigError, match=r"teacher\.character_topk: training\.objective 'topk_forward_kl'"
    ):
        config_from_dict(base_config)
    base_config["teacher"]["character_topk"] = 20
    base_config["training"]["temperature"] = 0.7
    with pytest.raises(
        ConfigError, match=r"training\.temperature: a cross_tokenizer teacher's likely"
    ):
        config_from_dict(base_config)
