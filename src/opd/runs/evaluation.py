"""Held-out evaluation: greedy accuracy, pass@1 at the sampling temperature, and teacher KL."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from opd.data.prompts import Prompt
from opd.data.render import ChatRenderer
from opd.objectives.advantages import reverse_kl_per_token
from opd.runs.graders import Grader
from opd.sampling.base import Completion, Sampler
from opd.teachers.local import LocalTeacher
from opd.teachers.remote import RemoteTeacher
from opd.trainer.rollouts import build_rollout_batch


@dataclass
class EvalSet:
    """Held-out prompts of one dataset, how to grade them, and the teacher that scores them."""

    name: str
    prompts: list[Prompt]
    grader: Grader | None
    teacher: LocalTeacher | RemoteTeacher | None


def graded(
    renderer: ChatRenderer, completions: list[Completion], prompts: list[Prompt], grader: Grader
) -> float:
    """Mean grade of completions (special tokens removed) against their prompts."""
    grades = [
        grader(renderer.tokenizer.decode(c.token_ids, skip_special_tokens=True), p)
        for c, p in zip(completions, prompts, strict=True)
    ]
    return sum(grades) / len(grades)


def accuracy(
    sampler: Sampler, renderer: ChatRenderer, prompts: list[Prompt], grader: Grader, *, max_tokens: int
):
    """Mean grade of greedy completions."""
    rendered = [renderer.prompt_ids(p.messages) for p in prompts]
    completions = sampler.sample(rendered, temperature=1.0, max_tokens=max_tokens, greedy=True)
    return graded(renderer, completions, prompts, grader)


def sampled_teacher_kl(
    teacher: LocalTeacher | RemoteTeacher,
    rendered: list[list[int]],
    completions: list[Completion],
    pad_id: int,
) -> float:
    """Sampled-token reverse KL per completion token of the given student samples."""
    batch = build_rollout_batch(rendered, completions, [0] * len(rendered), pad_id)
    masks = [row.bool().tolist() for row in batch.mask_BT]
    teacher_logprobs = torch.zeros_like(batch.sampled_logprobs_BT)
    for row, values in enumerate(teacher.score(batch.sequences, masks).logprobs):
        teacher_logprobs[row, : values.shape[0]] = values
    kl = reverse_kl_per_token(batch.sampled_logprobs_BT, teacher_logprobs, batch.mask_BT)
    return float(kl.sum() / batch.mask_BT.sum().clamp(min=1))


def evaluate(
    sampler: Sampler,
    renderer: ChatRenderer,
    eval_sets: list[EvalSet],
    *,
    temperature: float,
    max_tokens: int,
    seed: int,
    pad_id: int,
) -> dict[str, float]:
    """``test/<name>/accuracy`` (greedy), ``test/<name>/pass@1`` and ``test/<name>/teacher_kl`` (sampled)."""
    metrics: dict[str, float] = {}
    for eval_set in eval_sets:
        prefix = f"test/{eval_set.name}"
        rendered = [renderer.prompt_ids(p.messages) for p in eval_set.prompts]
        if eval_set.grader is not None:
            greedy = sampler.sample(rendered, temperature=1.0, max_tokens=max_tokens, greedy=True)
            metrics[f"{prefix}/accuracy"] = graded(renderer, greedy, eval_set.prompts, eval_set.grader)
        torch.manual_seed(seed)
        sampled = sampler.sample(rendered, temperature=temperature, max_tokens=max_tokens)
        if eval_set.grader is not None:
            metrics[f"{prefix}/pass@1"] = graded(renderer, sampled, eval_set.prompts, eval_set.grader)
        if eval_set.teacher is not None:
            metrics[f"{prefix}/teacher_kl"] = sampled_teacher_kl(eval_set.teacher, rendered, sampled, pad_id)
    return metrics
