"""Held-out evaluation: greedy accuracy (the share of answers fully right) beside the grader's mean
score (partial credit where it gives any), pass@1 at the sampling temperature, and teacher KL."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from opd.data.graders import Grader
from opd.data.prompts import Prompt
from opd.data.render import ChatRenderer
from opd.data.rewards import completion_reward
from opd.data.sequences import Completion, RolloutBatch, build_rollout_batch
from opd.distributed import all_reduce, world
from opd.envs.base import Environment
from opd.envs.registry import EnvConfig
from opd.objectives.advantages import reverse_kl_per_token
from opd.sampling.base import Sampler, row_seed
from opd.sampling.episodes import EpisodeSpec, play_episodes

TeacherScorer = Callable[[RolloutBatch], torch.Tensor]
"""Teacher log-probs (B, T) of a batch's completion tokens, laid out like the batch."""


@dataclass
class EvalSet:
    """Held-out prompts of one dataset, how to grade them, and how its teacher scores them."""

    name: str
    dataset_index: int
    prompts: list[Prompt]
    grader: Grader | None
    score: TeacherScorer | None
    env: EnvConfig | None = None
    """Its environment: each prompt is an episode, graded by the episode's reward (the sum of its
    steps')."""
    environment: Environment | None = None

    def episodes(self, prompts: list[Prompt], max_tokens: int) -> list[EpisodeSpec] | None:
        """Fresh episodes of ``prompts`` (None: the set is single-turn)."""
        if self.environment is None:
            return None
        return [
            EpisodeSpec(
                self.environment.start(prompt, self.grader),
                prompt.messages,
                self.env.max_turns,
                self.env.episode_tokens(max_tokens),
                f"{self.name} (evaluation)",
                self.env.step_workers,
            )
            for prompt in prompts
        ]


def grades(
    renderer: ChatRenderer,
    completions: list[Completion],
    prompts: list[Prompt],
    grader: Grader | None,
) -> list[float]:
    """The grade of each completion (special tokens removed) against its prompt; an episode's grade
    is its reward, the sum of its steps' (0 when its environment gave none)."""
    return [
        completion_reward(renderer.tokenizer, c, p, grader) or 0.0
        for c, p in zip(completions, prompts, strict=True)
    ]


def graded_sum(
    renderer: ChatRenderer,
    completions: list[Completion],
    prompts: list[Prompt],
    grader: Grader | None,
) -> float:
    """Sum of the grades of completions against their prompts (:func:`grades`)."""
    return sum(grades(renderer, completions, prompts, grader))


def right(values: list[float]) -> int:
    """How many grades are full marks: a partial-credit grader's near miss (reasoning-gym scores an
    answer holding the right number among other text above 0) is not a right answer."""
    return sum(value >= 1.0 for value in values)


def graded(
    renderer: ChatRenderer, completions: list[Completion], prompts: list[Prompt], grader: Grader
) -> float:
    """Mean grade of completions (special tokens removed) against their prompts."""
    return graded_sum(renderer, completions, prompts, grader) / len(prompts)


def accuracy(
    sampler: Sampler,
    renderer: ChatRenderer,
    prompts: list[Prompt],
    grader: Grader,
    *,
    max_tokens: int,
    rendered: list[list[int]] | None = None,
) -> float:
    """Mean grade of greedy completions; ``rendered`` (the prompts' token ids) if already at
    hand."""
    if rendered is None:
        rendered = [renderer.prompt_ids(p.messages) for p in prompts]
    completions = sampler.sample(rendered, temperature=1.0, max_tokens=max_tokens, greedy=True)
    return graded(renderer, completions, prompts, grader)


def play(
    sampler: Sampler,
    renderer: ChatRenderer,
    eval_set: EvalSet,
    prompts: list[Prompt],
    rendered: list[list[int]],
    seeds: list[int],
    temperature: float,
    max_tokens: int,
    *,
    greedy: bool = False,
) -> list[Completion]:
    """A completion of each prompt (``rendered``: their token ids), or its environment's episode."""

    def turn(rows, turn_prompts, conversations, turn_seeds, turn_max_tokens):
        return sampler.sample(
            turn_prompts,
            temperature=temperature,
            max_tokens=turn_max_tokens,
            greedy=greedy,
            seed=None if greedy else turn_seeds,
        )

    specs = eval_set.episodes(prompts, max_tokens)
    if specs is None:
        return turn(None, rendered, None, seeds, max_tokens)
    return play_episodes(turn, renderer, rendered, specs, seeds, max_tokens, lockstep=True)


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
    """``test/<name>/accuracy`` (greedy: the share of answers graded fully right),
    ``test/<name>/score`` (greedy: the grader's mean, partial credit included),
    ``test/<name>/pass@1`` (the share fully right at the sampling temperature) and
    ``test/<name>/teacher_kl`` (sampled), ``test/<name>/turns`` (an environment's sets: turns of the
    greedy episodes; their accuracy is the success rate, the episode's reward),
    and ``test/<name>/num_prompts``, the set's size, which says how far apart two accuracies can be
    by chance.

    Among several processes each evaluates every N-th prompt (each sampled with its own row's
    seed) and the sums are added up over processes: the figures are those one process gets. A
    process left without a prompt of its own evaluates the first one and counts it for nothing,
    so that every process makes the same calls (a sharded model's forwards are collectives).
    """
    processes = world()
    metrics: dict[str, float] = {}
    for eval_set in eval_sets:
        prefix = f"test/{eval_set.name}"
        indices = list(range(processes.rank, len(eval_set.prompts), processes.size))
        weight = 1.0 if indices else 0.0
        indices = indices or [0]
        prompts = [eval_set.prompts[i] for i in indices]
        rendered = [renderer.prompt_ids(p.messages) for p in prompts]
        seeds = [row_seed(seed, i) for i in indices]
        sums: dict[str, float] = {"prompts": len(prompts)}

        graded = eval_set.grader is not None or eval_set.environment is not None
        if graded:
            greedy = play(
                sampler, renderer, eval_set, prompts, rendered, seeds, 1.0, max_tokens, greedy=True
            )
            greedy_grades = grades(renderer, greedy, prompts, eval_set.grader)
            sums["accuracy"], sums["score"] = right(greedy_grades), sum(greedy_grades)
            if eval_set.environment is not None:
                sums["turns"] = sum(len(c.trajectory.turns) for c in greedy)
        sampled = play(
            sampler, renderer, eval_set, prompts, rendered, seeds, temperature, max_tokens
        )
        if graded:
            sums["pass@1"] = right(grades(renderer, sampled, prompts, eval_set.grader))
        if eval_set.score is not None:
            batch = build_rollout_batch(
                rendered,
                sampled,
                [eval_set.dataset_index] * len(rendered),
                pad_id,
                prompts,
            )
            kl = reverse_kl_per_token(
                batch.sampled_logprobs_BT, eval_set.score(batch), batch.mask_BT
            )
            sums["kl"], sums["tokens"] = float(kl.sum()), float(batch.mask_BT.sum())
        totals = dict(
            zip(sums, all_reduce([weight * value for value in sums.values()]), strict=True)
        )
        for key in ("accuracy", "score", "pass@1", "turns"):
            if key in totals:
                metrics[f"{prefix}/{key}"] = totals[key] / totals["prompts"]
        metrics[f"{prefix}/num_prompts"] = round(totals["prompts"])
        if "kl" in totals:
            metrics[f"{prefix}/teacher_kl"] = totals["kl"] / max(totals["tokens"], 1.0)
    return metrics
