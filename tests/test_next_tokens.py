"""A teacher with another tokenizer read as a top-k over the student's next tokens: by hand, against
the per-character split of the sampled text, and in a training step."""

import math
import random

import pytest
import torch

from opd.config import ConfigError, config_from_dict
from opd.data.render import ChatRenderer
from opd.demo.char_tokenizer import build_char_tokenizer
from opd.teachers.alignment import TeacherFormat, character_logprobs
from opd.teachers.next_tokens import PAD_LOGPROB, Candidate, StudentVocabulary, going_on, student_topk
from tests.test_alignment import bpe_tokenizer

CHARS = build_char_tokenizer()
STOP = 2


def masses(ways) -> dict[str, float]:
    """The probability of each student character the ways going on start with (a naive sum)."""
    out: dict[str, float] = {}
    for candidate, rest, logprob in ways:
        char = "<stop>" if candidate is not None and candidate.token_id == 99 else rest[0]
        out[char] = out.get(char, 0.0) + math.exp(logprob)
    return out


def topk(ways, k=8) -> dict[str, float]:
    """The student's top-k as {text: probability}, padding left out."""
    ids, logprobs = student_topk(ways, StudentVocabulary(CHARS, STOP), {99}, k)
    return {
        ("<stop>" if i == STOP else CHARS.decode([i])): math.exp(lp)
        for i, lp in zip(ids, logprobs, strict=True)
        if lp > PAD_LOGPROB
    }


def candidates(pairs, first_id=10):
    return [Candidate(first_id + n, text, math.log(p)) for n, (text, p) in enumerate(pairs)]


def test_the_next_characters_by_hand():
    # "abc" as the teacher's "ab" (p 0.5) then "c" (p 0.9), as in test_alignment's hand example;
    # at "ab": "a" 0.1, "ax" 0.1, "abd" 0.1, "abc" 0.05, "b" 0.1; at "c": "cd" 0.05; at the end of
    # turn: the end (id 99) 0.8, "x" 0.1
    first = candidates([("ab", 0.5), ("a", 0.1), ("ax", 0.1), ("abd", 0.1), ("abc", 0.05), ("b", 0.1)])
    second = candidates([("c", 0.9), ("cd", 0.05)])
    end = [Candidate(99, "<|im_end|>", math.log(0.8)), *candidates([("x", 0.1)])]
    # before "a": every likely token's first character
    assert masses(going_on("abc", 0, 0, first, None)) == pytest.approx({"a": 0.85, "b": 0.1})
    # after "a", inside "ab": the tokens starting with "a" (0.85), going on past it; "a" alone
    # ends there (its next character is not known here: the tail)
    assert masses(going_on("abc", 0, 1, first, None)) == pytest.approx({"b": 0.65 / 0.85, "x": 0.1 / 0.85})
    # after "ab": "ab" ended (0.5 of the 0.65 going on with "ab") and "c"/"cd" follow, or "abd"/"abc"
    ways = going_on("abc", 2, 2, second, ("ab", first))
    assert masses(ways) == pytest.approx({"c": (0.5 * 0.95 + 0.05) / 0.65, "d": 0.1 / 0.65})
    # after "abc": "c" ended (0.9 of 0.95) and the end of turn or "x" follows, or "cd" goes on
    ways = going_on("abc", 3, 3, end, ("c", second))
    expected = {"<stop>": 0.8 * 0.9 / 0.95, "x": 0.1 * 0.9 / 0.95, "d": 0.05 / 0.95}
    assert masses(ways) == pytest.approx(expected)
    # the student's top-k: shares of the mass the ways place (0.86 / 0.95 here), the top 2 of them
    assert topk(ways, 2) == pytest.approx({"<stop>": 0.72 / 0.86, "x": 0.09 / 0.86})
    # the ways "a" alone ends in (0.1 after "a") place nothing: "b" and "x" share all of it
    assert topk(going_on("abc", 0, 1, first, None)) == pytest.approx({"b": 0.65 / 0.75, "x": 0.1 / 0.75})


def test_a_student_token_gets_the_mass_of_every_way_it_starts():
    # a student whose tokens are longer than one character: each way goes to the student's longest
    # token that starts it, and a way that no student token starts is the tail
    tokenizer = bpe_tokenizer()
    word = next(t for t in tokenizer.get_vocab() if len(t) >= 2 and t.isalpha())
    word_id, letter_id = tokenizer.convert_tokens_to_ids([word, word[0]])
    snowman = "\u2603"  # no token has it
    ways = going_on(
        word, 0, 0, candidates([(word, 0.5), (word + snowman, 0.1), (word[0], 0.2), (snowman, 0.1)]), None
    )
    ids, logprobs = student_topk(ways, StudentVocabulary(tokenizer, 0), set(), 4)
    got = {i: math.exp(lp) for i, lp in zip(ids, logprobs, strict=True) if lp > PAD_LOGPROB}
    assert got == pytest.approx({word_id: 0.6 / 0.8, letter_id: 0.2 / 0.8})  # the snowman places nothing
    assert len(set(ids)) == 4  # padded with distinct ids of no mass


def test_the_sampled_characters_share_follows_its_per_character_logprob():
    """Over a BPE teacher's real tokenization of random text, with random likely tokens: each row
    places all the mass on distinct ids, and each student character's entry is the log-prob the
    per-character split gives it, over a mass the ways place (at most all of it): the student's
    own character is the one way the teacher's own token always places."""
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
            logits = torch.randn(vocab, generator=torch.Generator().manual_seed(rng.randrange(10**6))) * 3
            logprobs = torch.log_softmax(logits, -1)
            top = logprobs.topk(12)
            topk.append(list(zip(top.indices.tolist(), top.values.tolist(), strict=True)))
            own_logprobs.append(logprobs)
        body = built.token_ids[piece.start : piece.start + width]
        teacher = [float(own_logprobs[p][token]) for p, token in enumerate(body)]
        view = fmt.student_view(built, piece, teacher, [-1.0] * len(ids), topk)
        rows = fmt.student_next_tokens(built, piece, teacher, topk, ids, view, 32)
        assert len(rows) == len(ids)
        for j, (token, (row_ids, row_logprobs)) in enumerate(zip(ids, rows, strict=True)):
            assert len(set(row_ids)) == 32 and sum(math.exp(lp) for lp in row_logprobs) == pytest.approx(1)
            placed = math.exp(view[j] - row_logprobs[row_ids.index(token)])
            assert 0 < placed <= 1 + 1e-6, (trial, text, j)


def test_character_logprobs_and_next_tokens_agree_on_the_hand_example():
    first = [("a", 0.1), ("ax", 0.1), ("abd", 0.1), ("abc", 0.05), ("b", 0.1)]
    alternatives = [[(t, math.log(p)) for t, p in first], [("cd", math.log(0.05))]]
    chars, _ = character_logprobs("abc", [(0, 2), (2, 3)], [math.log(0.5), math.log(0.9)], alternatives)
    ab = candidates([("ab", 0.5), *first])
    c = candidates([("c", 0.9), ("cd", 0.05)])
    assert [
        math.log(masses(going_on("abc", 0, 0, ab, None))["a"]),
        math.log(masses(going_on("abc", 0, 1, ab, None))["b"]),
        math.log(masses(going_on("abc", 2, 2, c, ("ab", ab)))["c"]),
    ] == pytest.approx(chars)


def test_the_top_k_with_a_cross_tokenizer_teacher_needs_its_likely_tokens(base_config):
    base_config["teacher"].update(cross_tokenizer=True, character_topk=0)
    base_config["training"]["objective"] = "topk_forward_kl"
    with pytest.raises(ConfigError, match=r"teacher\.character_topk: training\.objective 'topk_forward_kl'"):
        config_from_dict(base_config)
    base_config["teacher"]["character_topk"] = 20
    base_config["training"]["temperature"] = 0.7
    with pytest.raises(ConfigError, match=r"training\.temperature: a cross_tokenizer teacher's likely"):
        config_from_dict(base_config)
