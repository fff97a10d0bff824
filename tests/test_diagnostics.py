"""The figures that say why a run stalls (opd.trainer.diagnostics), against values worked by hand
on the character tokenizer (one token a character, the end of turn a special token)."""

from __future__ import annotations

import math

import pytest
import torch

from opd.data.graders import exact_match, last_number_match
from opd.data.prompts import Prompt
from opd.data.sequences import Completion, build_rollout_batch
from opd.objectives.advantages import reverse_kl_per_token
from opd.teachers.base import TeacherScores
from opd.trainer.diagnostics import diagnostic_metrics

END = 2  # the character tokenizer's <|im_end|>


def batch_of(tokenizer, texts: list[str], answer: str, dataset_indices: list[int] | None = None):
    prompt = Prompt(({"role": "user", "content": "q"},), answer=answer)
    prompt_ids = [5, 6, 7]
    completions = []
    for text in texts:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"] + [END]
        completions.append(Completion(ids, [-0.5] * len(ids), True))
    indices = dataset_indices or [0] * len(texts)
    return build_rollout_batch(
        [prompt_ids] * len(texts), completions, indices, 0, [prompt] * len(texts)
    )


def test_distinct_share_of_a_group(char_tokenizer):
    rows = batch_of(char_tokenizer, ["ab", "ab", "ab", "cd", "ab", "xy"], "ab")
    teacher = TeacherScores(torch.full_like(rows.sampled_logprobs_BT, -1.0))
    kl = reverse_kl_per_token(rows.sampled_logprobs_BT, teacher.logprobs_BT, rows.mask_BT)
    groups = torch.tensor([0, 0, 1, 1, 2, 2])
    metrics = diagnostic_metrics(rows, groups, kl, teacher, None, [None], char_tokenizer)
    assert metrics == {"group/distinct": pytest.approx((1 / 2 + 2 / 2 + 2 / 2) / 3)}


def test_the_kl_split_at_the_answer_and_the_teachers_word_where_a_wrong_answer_parts(
    char_tokenizer,
):
    # "so 12" against 13 (last number): the answer is characters 3-4, tokens 3-4; it parts at "2"
    rows = batch_of(char_tokenizer, ["so 12", "so 13"], "13")
    start = rows.prompt_lengths[0]
    teacher_BT = torch.full_like(rows.sampled_logprobs_BT, -1.0)
    teacher_BT[0, start + 4] = math.log(0.2)  # the teacher's probability of the wrong "2"
    teacher_BT[:, start + 3] = -3.0
    teacher = TeacherScores(teacher_BT * rows.mask_BT)
    kl = reverse_kl_per_token(rows.sampled_logprobs_BT, teacher.logprobs_BT, rows.mask_BT)
    rewards = torch.tensor([0.0, 1.0], dtype=torch.float64)
    groups = torch.tensor([0, 0])
    metrics = diagnostic_metrics(
        rows, groups, kl, teacher, rewards, [last_number_match], char_tokenizer
    )
    # answer tokens: row 0 "1" (-0.5+3) and "2" (-0.5-ln 0.2), row 1 "1" (2.5) and "3" (0.5)
    answer = (2.5 + (-0.5 - math.log(0.2)) + 2.5 + 0.5) / 4
    # the rest: "s", "o", " " and the end of turn, each -0.5 - (-1) = 0.5, on both rows
    assert metrics["teacher_kl/answer"] == pytest.approx(answer)
    assert metrics["teacher_kl/reasoning"] == pytest.approx(0.5)
    assert metrics["diag/first_wrong_teacher_prob"] == pytest.approx(
        0.2
    )  # the right row is not counted
    assert metrics["group/distinct"] == 1.0


def test_a_wrong_answer_that_stops_short_parts_at_the_token_after_it(char_tokenizer):
    # "cb" for "cba" (exact match): the answer is the whole text; it parts where "a" should come,
    # the end of turn (special: no character of its own), which is not located, so not counted
    rows = batch_of(char_tokenizer, ["cab", "cb"], "cba")
    teacher = TeacherScores(torch.full_like(rows.sampled_logprobs_BT, math.log(0.9)) * rows.mask_BT)
    kl = reverse_kl_per_token(rows.sampled_logprobs_BT, teacher.logprobs_BT, rows.mask_BT)
    rewards = torch.tensor([0.0, 0.0], dtype=torch.float64)
    metrics = diagnostic_metrics(
        rows, torch.tensor([0, 1]), kl, teacher, rewards, [exact_match], char_tokenizer
    )
    assert metrics["diag/first_wrong_teacher_prob"] == pytest.approx(0.9)  # "cab": parts at "a"
    assert "group/distinct" not in metrics  # groups of one say nothing of diversity


def test_the_teachers_top_k_mass_and_rows_no_grader_can_read(char_tokenizer):
    rows = batch_of(char_tokenizer, ["ab", "cd"], "ab")
    teacher = TeacherScores(
        torch.full_like(rows.sampled_logprobs_BT, -1.0),
        topk_ids_BTK=torch.zeros(*rows.mask_BT.shape, 2, dtype=torch.long),
        topk_logprobs_BTK=torch.log(torch.tensor([0.5, 0.25]))
        .expand(*rows.mask_BT.shape, 2)
        .clone(),
    )
    kl = reverse_kl_per_token(rows.sampled_logprobs_BT, teacher.logprobs_BT, rows.mask_BT)
    metrics = diagnostic_metrics(
        rows, torch.tensor([0, 0]), kl, teacher, None, [None], char_tokenizer
    )
    assert metrics["teacher/topk_mass"] == pytest.approx(0.75)
    assert "teacher_kl/answer" not in metrics  # no grader: no answer located
