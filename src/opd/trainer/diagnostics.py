"""Why a run stalls, in figures logged every on-policy step: how varied a group's samples are, how
the teacher KL splits between the answer and the reasoning before it, how much of the teacher's
distribution its top-k holds, and how the teacher judged the token where a wrong answer first
parted from the right one. ``opd report`` draws them with a line of what each means.

Each figure is summed on every process and reduced together (a group's rows lie on one process),
so it does not depend on how the batch is shared.
"""

from __future__ import annotations

import math
from bisect import bisect_right

import torch

from opd.data.graders import Grader, answer_location
from opd.data.sequences import RolloutBatch
from opd.distributed import all_reduce
from opd.teachers.base import TeacherScores


def distinct_shares(rollouts: RolloutBatch, groups_B: torch.Tensor) -> tuple[float, float]:
    """(sum over groups of ``distinct completions / group size``, groups of two or more rows): 1 is
    every sample different, ``1 / group_size`` all alike (a collapsed student draws one answer)."""
    completions: dict[int, list[tuple[int, ...]]] = {}
    for row, sequence in enumerate(rollouts.sequences):
        tokens = tuple(sequence[rollouts.prompt_lengths[row] :])
        completions.setdefault(int(groups_B[row]), []).append(tokens)
    shares = [len(set(rows)) / len(rows) for rows in completions.values() if len(rows) > 1]
    return sum(shares), float(len(shares))


def _token_at(tokenizer, token_ids: list[int], char: int) -> int | None:
    """The index of the token whose decoded text holds character ``char`` of the decoded
    completion (special tokens removed, as graders read it), by bisecting prefix lengths."""
    lengths = _PrefixLengths(tokenizer, token_ids)
    index = bisect_right(lengths, char)
    return index if index < len(token_ids) else None


class _PrefixLengths:
    """``len(decode(token_ids[: i + 1]))`` on demand, a sequence for :func:`bisect_right`."""

    def __init__(self, tokenizer, token_ids: list[int]) -> None:
        self.tokenizer, self.token_ids = tokenizer, token_ids

    def __len__(self) -> int:
        return len(self.token_ids)

    def __getitem__(self, index: int) -> int:
        text = self.tokenizer.decode(self.token_ids[: index + 1], skip_special_tokens=True)
        return len(text)


def answer_sums(
    rollouts: RolloutBatch,
    reverse_kl_BT: torch.Tensor,
    teacher_logprobs_BT: torch.Tensor,
    rewards_B: torch.Tensor | None,
    graders: list[Grader | None],
    tokenizer,
) -> list[float]:
    """[answer KL, answer tokens, other KL, other tokens, teacher prob at first wrong token, wrong
    answers located] over the single-turn rows whose grader locates an answer."""
    sums = [0.0] * 6
    for row, prompt in enumerate(rollouts.prompt_records):
        grader = graders[int(rollouts.dataset_index_B[row])]
        if grader is None or (rollouts.trajectories and rollouts.trajectories[row] is not None):
            continue
        start = rollouts.prompt_lengths[row]
        end = int(rollouts.attention_mask_BT[row].sum())
        token_ids = rollouts.input_ids_BT[row, start:end].tolist()
        text = tokenizer.decode(token_ids, skip_special_tokens=True)
        located = answer_location(grader, text, prompt)
        if located is None:
            continue
        first_char, last_char, reference = located
        first = _token_at(tokenizer, token_ids, first_char)
        last = _token_at(tokenizer, token_ids, last_char - 1)
        if first is None or last is None:
            continue
        kl = reverse_kl_BT[row, start:end].double()
        answer = kl[first : last + 1]
        sums[0] += float(answer.sum())
        sums[1] += answer.numel()
        sums[2] += float(kl.sum()) - float(answer.sum())
        sums[3] += len(token_ids) - answer.numel()
        wrong = (
            rewards_B is not None and not math.isnan(rewards_B[row]) and float(rewards_B[row]) < 1.0
        )
        written = text[first_char:last_char]
        if not wrong or written == reference:
            continue
        parted = next(
            (i for i, (a, b) in enumerate(zip(written, reference, strict=False)) if a != b),
            min(len(written), len(reference)),
        )
        token = _token_at(tokenizer, token_ids, first_char + parted)
        if token is None:
            continue
        sums[4] += math.exp(float(teacher_logprobs_BT[row, start + token]))
        sums[5] += 1
    return sums


def diagnostic_metrics(
    rollouts: RolloutBatch,
    groups_B: torch.Tensor,
    reverse_kl_BT: torch.Tensor,
    teacher: TeacherScores,
    rewards_B: torch.Tensor | None,
    graders: list[Grader | None],
    tokenizer,
) -> dict[str, float]:
    """``group/distinct``; ``teacher_kl/answer`` and ``teacher_kl/reasoning`` (per token, where a
    grader locates the answer); ``diag/first_wrong_teacher_prob`` (the teacher's probability of the
    student's token where a wrong answer first differs from the right one: near 1, the teacher
    agreed with the mistake; near 0, it pointed at it); ``teacher/topk_mass`` (the probability the
    teacher's top-k holds, where it sent them)."""
    mask = rollouts.mask_BT.bool()
    shares, groups = distinct_shares(rollouts, groups_B)
    located = answer_sums(
        rollouts, reverse_kl_BT, teacher.logprobs_BT, rewards_B, graders, tokenizer
    )
    mass = [0.0, 0.0]
    if teacher.topk_logprobs_BTK is not None:
        held = teacher.topk_logprobs_BTK.float().exp().sum(-1)[mask]
        mass = [float(held.double().sum()), float(held.numel())]
    sums = all_reduce([shares, groups, *located, *mass])
    metrics = {}
    names = (
        ("group/distinct", 0, 1),
        ("teacher_kl/answer", 2, 3),
        ("teacher_kl/reasoning", 4, 5),
        ("diag/first_wrong_teacher_prob", 6, 7),
        ("teacher/topk_mass", 8, 9),
    )
    for name, total, count in names:
        if sums[count] > 0:
            metrics[name] = sums[total] / sums[count]
    return metrics
