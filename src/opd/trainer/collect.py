"""Collection, the first room of a step: the step's prompts for this process, completions from
the step's data source (the student's engine, a teacher that writes, or the dataset), each row
an episode of its dataset's environment where it has one, and the teachers' scores of the same
tokens: a finished :class:`Batch`. The worker collecting ahead (:mod:`opd.trainer.ahead`) runs
the same :meth:`Collector.collect` on its own engine."""

from __future__ import annotations

import math
import random
import time
from dataclasses import replace
from typing import NamedTuple

import torch

from opd.assemble.run import RunComponents
from opd.config import TrainingConfig
from opd.data.prompts import Prompt
from opd.data.rewards import completion_reward
from opd.data.sequences import Completion, RolloutBatch, build_rollout_batch
from opd.errors import EpisodeError
from opd.runs.timing import SpanRecorder
from opd.sampling.base import RolloutEngine, SamplingParams, row_seed
from opd.sampling.episodes import EpisodeSpec, TurnSampler, play_episodes, play_episodes_streamed
from opd.teachers.writer import write_rows
from opd.trainer.batch import Batch
from opd.trainer.sft import completion_tokens


def step_seed(seed: int, step: int) -> int:
    """Sampling at step ``step`` depends only on (seed, step): a resumed run samples the same."""
    return (seed * 1_000_003 + step) % (2**63)


def step_data_source(training: TrainingConfig, seed: int, step: int) -> str:
    """Who writes step ``step``'s completions. ``mixed``: the student with probability
    ``lmbda`` at that step, drawn from (seed, step) alone, so a resumed run draws the same."""
    if training.data_source != "mixed":
        return training.data_source
    on_policy = random.Random(f"{seed}/mixed/{step}").random() < training.lmbda_at(step)
    return "student" if on_policy else "teacher"


class Sampled(NamedTuple):
    """A step's rollouts (this process's share), who wrote them, and what the task says of them."""

    rollouts: RolloutBatch
    source: str
    rewards_B: torch.Tensor | None
    """Each row's reward (NaN where its dataset gives none; None: the student did not write the
    batch, or no dataset of the run has a grader or an environment)."""
    groups_B: torch.Tensor
    """Each row's group: the index of its prompt in the step."""
    sync_seconds: float | None = None
    """Seconds spent bringing the run's engine to the trained weights first (None: not synced
    here)."""


class Collector:
    """Sampling, episodes and scoring of a step's batch, from the run's parts (read as they are
    when a step is collected: a test or the loop may swap an engine)."""

    def __init__(self, parts: RunComponents):
        self.parts = parts
        self.spans = SpanRecorder(None)
        """Where each phase's time is recorded (the run loop gives its own)."""

    def data_source_at(self, step: int) -> str:
        """Who writes step ``step``'s completions: ``student``, ``teacher`` or ``dataset``."""
        return step_data_source(self.parts.config.training, self.parts.config.seed, step)

    def sample_batch(
        self, step: int, engine: RolloutEngine | None = None
    ) -> tuple[RolloutBatch, str]:
        """This process's share of step ``step``'s rollouts and who wrote them (:meth:`sample`)."""
        sampled = self.sample(step, engine)
        return sampled.rollouts, sampled.source

    def sample(self, step: int, engine: RolloutEngine | None = None) -> Sampled:
        """Render this process's share of the step's prompts and get their completions from the
        step's data source; the student's own samples are graded too (:meth:`rewards`).

        The student and teachers sample ``group_size`` completions per prompt, each row seeded
        by (run seed, step, its row in the whole batch), so the rows drawn do not depend on how
        the batch is shared among processes; a dataset gives its one completion per prompt.
        ``engine`` (default: the run's) samples the student, synced first unless it was given
        already synced (a worker collecting ahead holds published weights).
        """
        source = self.data_source_at(step)
        sync_seconds = None
        prompts, completions, dataset_indices, items, groups = [], [], [], [], []
        for group, item in enumerate(self.parts.batches.batch(step)):
            group_size = (
                1
                if source == "dataset"
                else self.parts.config.datasets[item.dataset_index].group_size
            )
            if source == "dataset":
                prompt_ids, target = completion_tokens(self.parts.renderer, item.prompt)
                completions.append(Completion(target, [0.0] * len(target), finished=True))
            else:
                prompt_ids = self.parts.renderer.prompt_ids(item.prompt.messages)
            prompts += [prompt_ids] * group_size
            dataset_indices += [item.dataset_index] * group_size
            items += [item.prompt] * group_size
            groups += [group] * group_size
        rows = self.parts.rank_rows
        prompts, dataset_indices, items, groups = (
            [values[r] for r in rows] for values in (prompts, dataset_indices, items, groups)
        )
        seeds = [row_seed(step_seed(self.parts.config.seed, step), r) for r in rows]
        training = self.parts.config.training
        params = SamplingParams(temperature=training.temperature, max_tokens=training.max_tokens)
        if source == "dataset":
            completions = [completions[r] for r in rows]
        else:
            if source == "student":
                if engine is None:
                    engine = self.parts.engine
                    synced = time.perf_counter()
                    engine.sync(self.parts.policy)
                    sync_seconds = time.perf_counter() - synced
                    lockstep = True
                else:
                    lockstep = (
                        False  # the worker collecting ahead: no collectives off the main thread
                    )

                def sample(turn_rows, turn_prompts, conversations, turn_seeds, max_tokens):
                    return engine.rollout(
                        turn_prompts, replace(params, max_tokens=max_tokens), seeds=turn_seeds
                    )

            else:
                lockstep = True

                def sample(turn_rows, turn_prompts, conversations, turn_seeds, max_tokens):
                    return write_rows(
                        [self.parts.teacher_writers[dataset_indices[r]] for r in turn_rows],
                        turn_prompts,
                        conversations,
                        replace(params, max_tokens=max_tokens),
                        turn_seeds,
                        [items[r] for r in turn_rows],
                    )

            try:
                completions = self.play(
                    sample,
                    prompts,
                    items,
                    dataset_indices,
                    seeds,
                    lockstep=lockstep,
                    engine=engine if source == "student" else None,
                )
            except EpisodeError as error:
                raise EpisodeError(f"step {step}: {error}") from None
        rollouts = build_rollout_batch(
            prompts, completions, dataset_indices, self.parts.engine.pad_id, items
        )
        rewards = self.rewards(completions, items, dataset_indices) if source == "student" else None
        return Sampled(
            rollouts, source, rewards, torch.tensor(groups, dtype=torch.long), sync_seconds
        )

    def rewards(
        self, completions: list[Completion], items: list[Prompt], dataset_indices: list[int]
    ) -> torch.Tensor | None:
        """Each row's reward: its episode's reward (the sum of its steps'), or its grade by its
        dataset's grader (NaN where its dataset has neither); None when no dataset of the run has
        either. Decided by the run's datasets, not by this process's rows: every process then
        reduces the reward metrics together, whatever share of the datasets its rows come from."""
        if all(
            g is None and e is None
            for g, e in zip(self.parts.graders, self.parts.environments, strict=True)
        ):
            return None
        values = [
            completion_reward(self.parts.tokenizer, completion, prompt, self.parts.graders[index])
            for completion, prompt, index in zip(completions, items, dataset_indices, strict=True)
        ]
        return torch.tensor([math.nan if v is None else v for v in values], dtype=torch.float64)

    def play(
        self,
        sample: TurnSampler,
        prompts: list[list[int]],
        items: list[Prompt],
        dataset_indices: list[int],
        seeds: list[int],
        *,
        lockstep: bool,
        engine: RolloutEngine | None = None,
    ) -> list[Completion]:
        """Each row's completion from ``sample``: one turn, or its dataset's environment's episode.
        Episodes are played on ``engine``'s turn stream where it has one (the vLLM engines): each
        row's next turn starts when its environment answered, not when the batch's slowest turn
        ends."""
        training = self.parts.config.training
        max_tokens = training.max_tokens
        if not any(self.parts.environments):
            return sample(
                list(range(len(prompts))), prompts, [p.messages for p in items], seeds, max_tokens
            )
        specs = [
            self.episode_spec(index, item)
            for index, item in zip(dataset_indices, items, strict=True)
        ]
        if (turn_stream := getattr(engine, "turn_stream", None)) is not None:
            params = SamplingParams(temperature=training.temperature, max_tokens=max_tokens)
            with turn_stream(params) as stream:
                if stream is not None:
                    return play_episodes_streamed(
                        stream, self.parts.renderer, prompts, specs, seeds, max_tokens
                    )
        return play_episodes(
            sample, self.parts.renderer, prompts, specs, seeds, max_tokens, lockstep=lockstep
        )

    def episode_spec(self, dataset_index: int, prompt: Prompt) -> EpisodeSpec:
        """How a row of dataset ``dataset_index`` is played: an episode of its environment, or one
        turn."""
        environment, dataset = (
            self.parts.environments[dataset_index],
            self.parts.config.datasets[dataset_index],
        )
        if environment is None:
            return EpisodeSpec(None, prompt.messages)
        return EpisodeSpec(
            environment.start(prompt, self.parts.graders[dataset_index]),
            prompt.messages,
            dataset.env.max_turns,
            dataset.env.episode_tokens(self.parts.config.training.max_tokens),
            f"datasets[{dataset_index}] ({dataset.name})",
            dataset.env.step_workers,
        )

    def collect(self, step: int, engine: RolloutEngine | None = None) -> Batch:
        """Step ``step``'s batch (this process's share): prompts, completions, and the teachers'
        scores of them. ``engine``: as :meth:`sample_batch` takes it."""
        started = time.perf_counter()
        with self.spans.span(step, "sample"):
            sampled = self.sample(step, engine)
        rollouts, source = sampled.rollouts, sampled.source
        sampled_at = time.perf_counter()
        teacher = None
        request = self.parts.config.training.objective_for(source).teacher_request(
            self.parts.config.training.temperature
        )
        if request is not None:  # SFT reads only the tokens: no teacher forward to pay for
            with self.spans.span(step, "teacher"):
                teacher = self.parts.teachers.score(rollouts, request)
        seconds = {
            "time/sample": sampled_at - started,
            "time/teacher": time.perf_counter() - sampled_at,
        }
        if sampled.sync_seconds is not None:
            seconds["time/weight_sync"] = sampled.sync_seconds
        return Batch(
            step,
            source,
            rollouts,
            teacher,
            seconds,
            rewards_B=sampled.rewards_B,
            groups_B=sampled.groups_B,
        )
