"""The on-policy distillation loop: collect a batch, learn from it, keep the run's records.

Each step: :meth:`Trainer.collect` takes prompts from every dataset, has the rollout engine
(or a teacher, or the dataset) write ``group_size`` completions per prompt, and has each
dataset's teacher score the same tokens with what the objective needs; :meth:`Trainer.learn`
turns that finished :class:`Batch` into advantages (for objectives that use them) and
``num_substeps`` optimizer steps. :meth:`Trainer.run` repeats this, evaluating, logging and
checkpointing on the way; what it is built from is set up in :mod:`opd.trainer.components`.
"""

from __future__ import annotations

import contextlib
import math
import random
import signal
import sys
import time
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
import yaml
from tqdm.auto import tqdm

from opd.config import Config, TrainingConfig, recorded_config
from opd.data.batching import contiguous_slices
from opd.data.prompts import Prompt
from opd.data.render import ChatRenderer
from opd.data.sequences import Completion, RolloutBatch, build_rollout_batch
from opd.distributed import all_reduce, barrier
from opd.errors import CheckpointError, DivergenceError, RunInterrupted
from opd.objectives.advantages import standardized
from opd.runs.checkpoints import restore_rng_states, save_checkpoint
from opd.runs.display import examples, sample_records
from opd.runs.evaluation import evaluate
from opd.runs.loggers import build_loggers
from opd.runs.metrics import JsonlWriter, MetricsWriter, read_jsonl
from opd.runs.resume import (
    CONFIG_NAME,
    METRICS_NAME,
    SAMPLES_NAME,
    TIMING_NAME,
    StartPoint,
    keep_metrics_before,
    prepare_log_path,
    resume_point,
)
from opd.runs.sharded_state import (
    has_sharded_state,
    load_indexed_optimizer_state,
    load_sharded_state,
    save_sharded_state,
)
from opd.runs.storage import check_log_path, disk_full_error, out_of_space
from opd.runs.timing import SpanRecorder, write_chrome_trace
from opd.runs.watchdog import Watchdog
from opd.sampling.base import RolloutEngine, SamplingParams, row_seed
from opd.sampling.episodes import EpisodeSpec, TurnSampler, play_episodes
from opd.teachers.writer import write_rows
from opd.trainer.ahead import AheadCollector
from opd.trainer.batch import Batch
from opd.trainer.components import RunComponents
from opd.trainer.episode_metrics import episode_metrics
from opd.trainer.sft import completion_tokens
from opd.trainer.stopping import StopOnSignal
from opd.trainer.update import policy_gradient, policy_update

PROGRESS_KEYS = {"teacher_kl": "kl", "entropy": "H", "completion_len_mean": "len"}
"""The metrics the progress bar shows, by the short names that keep it within 80 columns."""
PROGRESS_FORMAT = "{desc} |{bar:6}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}, {rate_fmt}{postfix}]"
"""A bar of fixed width, so a narrow terminal shortens nothing (tqdm's own shrinks the bar to a
character and cuts the metrics)."""


def show_phase(bar, phase: str) -> None:
    """Name on the bar what the run is doing between steps (an evaluation or a checkpoint can
    take minutes on a real model); the next step's metrics replace it."""
    bar.postfix = phase
    bar.refresh()


def progress_postfix(metrics: dict) -> str:
    """``kl 0.123 H 0.456 len 4.5``: the step's main metrics for the bar."""
    return " ".join(f"{short} {metrics[key]:.3g}" for key, short in PROGRESS_KEYS.items() if key in metrics)


def advantage_metrics(advantages_BT: torch.Tensor, mask_BT: torch.Tensor) -> dict[str, float]:
    """Mean, spread and extremes of the per-token advantages over every process's completion
    tokens: advantages of tens of nats mean the student writes what the teacher would not."""
    selected = advantages_BT[mask_BT.bool()].double()
    sums = [float(selected.sum()), float(selected.square().sum()), float(selected.numel())]
    total, squares, count = all_reduce(sums)
    if count == 0:
        return {}
    extremes = [float(-selected.min()), float(selected.max())] if selected.numel() else [-math.inf] * 2
    negated_min, most = all_reduce(extremes, op="max")
    mean = total / count
    return {
        "advantage/mean": mean,
        "advantage/std": math.sqrt(max(squares / count - mean * mean, 0.0)),
        "advantage/min": -negated_min,
        "advantage/max": most,
    }


@dataclass
class TrainResult:
    """What :func:`train` hands back: the trained student and every step's metrics."""

    student: torch.nn.Module
    tokenizer: object
    renderer: ChatRenderer
    metrics: list[dict] = field(default_factory=list)
    """The rows this call logged (a resumed run: from where it resumed; a finished one: none)."""
    log_path: Path = Path(".")

    def last(self, key: str) -> float:
        """The latest value of metric ``key`` over the whole run as ``metrics.jsonl`` records it, so
        it answers after a resume or a rerun of a finished run too (``test/<dataset>/accuracy``: the
        last evaluation)."""
        rows = read_jsonl(self.log_path / METRICS_NAME)
        values = [row[key] for row in rows if key in row]
        if not values:
            known = sorted({name for row in rows for name in row})
            raise KeyError(f"{key!r}: not a metric of the run in {self.log_path}; it logged {known}")
        return values[-1]


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


class Trainer(RunComponents):
    """One run: its components (:class:`RunComponents`), the step in two halves, and the loop."""

    def __init__(self, config: Config, *, progress: bool = True):
        super().__init__(config)
        self.progress = progress
        self.spans = SpanRecorder(None)
        self.sync_seconds = 0.0
        self.ahead: AheadCollector | None = None
        """The worker collecting ahead, while :meth:`run` runs with ``max_staleness`` > 0."""

    def data_source_at(self, step: int) -> str:
        """Who writes step ``step``'s completions: ``student``, ``teacher`` or ``dataset``."""
        return step_data_source(self.config.training, self.config.seed, step)

    def sample_batch(self, step: int, engine: RolloutEngine | None = None) -> tuple[RolloutBatch, str]:
        """Render this process's share of the step's prompts and get their completions from the
        step's data source.

        The student and teachers sample ``group_size`` completions per prompt, each row seeded
        by (run seed, step, its row in the whole batch), so the rows drawn do not depend on how
        the batch is shared among processes; a dataset gives its one completion per prompt.
        ``engine`` (default: the run's) samples the student, synced first unless it was given
        already synced (a worker collecting ahead holds published weights).
        """
        source = self.data_source_at(step)
        prompts, completions, dataset_indices, items = [], [], [], []
        for item in self.batches.batch(step):
            group_size = 1 if source == "dataset" else self.config.datasets[item.dataset_index].group_size
            if source == "dataset":
                prompt_ids, target = completion_tokens(self.renderer, item.prompt)
                completions.append(Completion(target, [0.0] * len(target), finished=True))
            else:
                prompt_ids = self.renderer.prompt_ids(item.prompt.messages)
            prompts += [prompt_ids] * group_size
            dataset_indices += [item.dataset_index] * group_size
            items += [item.prompt] * group_size
        rows = self.rank_rows
        prompts, dataset_indices, items = (
            [values[r] for r in rows] for values in (prompts, dataset_indices, items)
        )
        seeds = [row_seed(step_seed(self.config.seed, step), r) for r in rows]
        training = self.config.training
        params = SamplingParams(temperature=training.temperature, max_tokens=training.max_tokens)
        if source == "dataset":
            completions = [completions[r] for r in rows]
        else:
            if source == "student":
                if engine is None:
                    engine = self.engine
                    synced = time.perf_counter()
                    engine.sync(self.policy)
                    self.sync_seconds = time.perf_counter() - synced
                    lockstep = True
                else:
                    lockstep = False  # the worker collecting ahead: no collectives off the main thread

                def sample(turn_rows, turn_prompts, conversations, turn_seeds, max_tokens):
                    return engine.rollout(
                        turn_prompts, replace(params, max_tokens=max_tokens), seeds=turn_seeds
                    )

            else:
                lockstep = True

                def sample(turn_rows, turn_prompts, conversations, turn_seeds, max_tokens):
                    return write_rows(
                        [self.teacher_writers[dataset_indices[r]] for r in turn_rows],
                        turn_prompts,
                        conversations,
                        replace(params, max_tokens=max_tokens),
                        turn_seeds,
                    )

            completions = self.play(sample, prompts, items, dataset_indices, seeds, lockstep=lockstep)
        return build_rollout_batch(
            prompts, completions, dataset_indices, self.engine.pad_id, [p.messages for p in items]
        ), source

    def play(
        self,
        sample: TurnSampler,
        prompts: list[list[int]],
        items: list[Prompt],
        dataset_indices: list[int],
        seeds: list[int],
        *,
        lockstep: bool,
    ) -> list[Completion]:
        """Each row's completion from ``sample``: one turn, or its dataset's environment's episode."""
        max_tokens = self.config.training.max_tokens
        if not any(self.environments):
            return sample(list(range(len(prompts))), prompts, [p.messages for p in items], seeds, max_tokens)
        specs = [self.episode_spec(index, item) for index, item in zip(dataset_indices, items, strict=True)]
        return play_episodes(sample, self.renderer, prompts, specs, seeds, max_tokens, lockstep=lockstep)

    def episode_spec(self, dataset_index: int, prompt: Prompt) -> EpisodeSpec:
        """How a row of dataset ``dataset_index`` is played: an episode of its environment, or one turn."""
        environment, dataset = self.environments[dataset_index], self.config.datasets[dataset_index]
        if environment is None:
            return EpisodeSpec(None, prompt.messages)
        return EpisodeSpec(
            environment.start(prompt, self.graders[dataset_index]),
            prompt.messages,
            dataset.env.max_turns,
            dataset.env.episode_tokens(self.config.training.max_tokens),
            f"datasets[{dataset_index}] ({dataset.name})",
        )

    def collect(self, step: int, engine: RolloutEngine | None = None) -> Batch:
        """Step ``step``'s batch (this process's share): prompts, completions, and the teachers'
        scores of them. ``engine``: as :meth:`sample_batch` takes it."""
        started = time.perf_counter()
        with self.spans.span(step, "sample"):
            rollouts, source = self.sample_batch(step, engine)
        sampled_at = time.perf_counter()
        teacher = None
        request = self.config.training.objective_for(source).teacher_request(self.config.training.temperature)
        if request is not None:  # SFT reads only the tokens: no teacher forward to pay for
            with self.spans.span(step, "teacher"):
                teacher = self.teachers.score(rollouts, request)
        seconds = {
            "time/sample": sampled_at - started,
            "time/teacher": time.perf_counter() - sampled_at,
        }
        if source == "student" and engine is None:
            seconds["time/weight_sync"] = self.sync_seconds
        return Batch(step, source, rollouts, teacher, seconds)

    def kl_metrics(self, batch: Batch) -> dict[str, float]:
        """``teacher_kl`` = sum(reverse KL) / completion tokens, overall and per dataset (over
        every process's share)."""
        rollouts, reverse_kl = batch.rollouts, batch.reverse_kl_BT
        sums = [float(reverse_kl.sum()), float(rollouts.mask_BT.sum())]
        for index in range(len(self.config.datasets)):
            rows = rollouts.dataset_index_B == index
            sums += [float(reverse_kl[rows].sum()), float(rollouts.mask_BT[rows].sum())]
        sums = all_reduce(sums)
        metrics = {"teacher_kl": sums[0] / max(sums[1], 1.0)}
        for index, dataset in enumerate(self.config.datasets):
            kl, tokens = sums[2 + 2 * index : 4 + 2 * index]
            if tokens > 0:
                metrics[f"teacher_kl/{dataset.name}"] = kl / tokens
        return metrics

    def learn(self, batch: Batch) -> dict[str, float]:
        """Advantages and the update from a finished batch; returns the step's metrics (the whole
        batch's, reduced over processes, but for times, which are this process's)."""
        training, rollouts, teacher = self.config.training, batch.rollouts, batch.teacher
        objective = training.objective_for(batch.source)
        mask = rollouts.mask_BT
        lengths = mask.sum(-1)
        metrics: dict[str, float] = {"step": batch.step, "on_policy": int(batch.on_policy)}
        if self.config.training.data_source == "mixed":
            metrics["lmbda"] = self.config.training.lmbda_at(batch.step)
        if batch.on_policy and teacher is not None:
            metrics |= self.kl_metrics(batch)
        if any(self.environments):
            metrics |= episode_metrics(rollouts, batch.reverse_kl_BT if batch.on_policy else None)
        scored = mask.bool()
        finite = (teacher is None or bool(torch.isfinite(teacher.logprobs_BT[scored]).all())) and bool(
            torch.isfinite(rollouts.sampled_logprobs_BT[scored]).all()
        )
        tokens, sequences, truncated, not_finite = all_reduce(
            [
                float(lengths.sum()),
                float(mask.shape[0]),
                float((~rollouts.finished_B).sum()),
                float(not finite),
            ]
        )
        metrics |= {
            "num_tokens": int(tokens),
            "num_sequences": int(sequences),
            "completion_len_mean": tokens / sequences,
            "frac_truncated": truncated / sequences,
            "lr": self.scheduler.get_last_lr()[0],
        }
        if batch.staleness is not None:
            metrics["staleness_mean"] = batch.staleness
        if not_finite:
            warnings.warn(
                f"step {batch.step}: non-finite log-probs from the sampler or teacher; step skipped",
                stacklevel=2,
            )
            return metrics | {"skipped": 1} | batch.seconds
        advantages = torch.zeros_like(mask)
        if teacher is not None:
            student_logprobs = rollouts.sampled_logprobs_BT
            if training.advantage_source == "current" and batch.on_policy:
                student_logprobs = self.policy_logprobs(rollouts).to(student_logprobs.device)
            shaped = objective.advantages(student_logprobs, teacher, mask, policy_gradient(training))
            if shaped is not None:
                spread = advantage_metrics(shaped, mask)
                metrics |= spread
                advantages = (
                    standardized(shaped, mask, spread["advantage/mean"], spread["advantage/std"])
                    if training.normalize_advantages and spread
                    else shaped
                )
        started = time.perf_counter()
        with self.spans.span(batch.step, "train"):
            stats = policy_update(
                self.policy,
                objective,
                self.optimizer,
                self.scheduler,
                rollouts,
                teacher,
                advantages,
                training,
                self.batching,
            )
        train_seconds = time.perf_counter() - started
        metrics |= {
            "loss": stats.loss,
            f"objective/{objective.name}": stats.objective_value,
            "entropy": stats.entropy,
            "grad_norm": stats.grad_norm,
            "skipped": int(stats.applied_substeps == 0),
            **batch.seconds,
            "time/train": train_seconds,
            "time/total": batch.seconds["time/sample"] + batch.seconds["time/teacher"] + train_seconds,
        }
        if batch.on_policy:
            metrics["kl_sample_train"] = stats.kl_sample_train
            if self.config.compute_post_kl:
                metrics["post_kl"] = self.post_update_kl(rollouts)
        return metrics

    def train_step(self, step: int) -> dict[str, float]:
        """Collect step ``step``'s batch and learn from it; returns the step's metrics."""
        return self.learn(self.collect(step))

    @torch.no_grad()
    def policy_logprobs(self, rollouts: RolloutBatch) -> torch.Tensor:
        """The student's current log-prob of every completion token of ``rollouts`` (B, T), at the
        run's temperature, detached; forwarded in the update's own micro-batches (the same rows
        per forward on any number of processes, and no more memory than the update takes). A
        forward every process makes together when the student is sharded; with gradients on,
        FSDP would wait for a backward that never comes."""
        training = self.config.training
        logprobs_BT = torch.zeros_like(rollouts.sampled_logprobs_BT)
        for substep in contiguous_slices(len(rollouts.prompt_lengths), training.num_substeps):
            part = rollouts.select(substep)
            for rows in self.batching.split(part):
                piece = part.select(rows)
                logprobs, _ = self.policy.sequence_logprobs(
                    piece.input_ids_BT,
                    piece.attention_mask_BT,
                    piece.mask_BT,
                    temperature=training.temperature,
                    chunk_size=training.logprob_chunk_size,
                )
                logprobs_BT[[substep.start + row for row in rows]] = logprobs.to(logprobs_BT.device)
        self.policy.reshard()
        return logprobs_BT

    @torch.no_grad()
    def post_update_kl(self, rollouts: RolloutBatch) -> float:
        """KL(policy before || after) the update, per token, on the batch the student sampled."""
        logprobs = self.policy_logprobs(rollouts)
        mask = rollouts.mask_BT.to(logprobs.device)
        sampled = rollouts.sampled_logprobs_BT.to(logprobs.device)
        kl, tokens = all_reduce([float(((sampled - logprobs) * mask).sum()), float(mask.sum())])
        return kl / max(tokens, 1.0)

    def evaluate(self, step: int | None = None) -> dict[str, float]:
        """``test/*`` metrics of the current student on every dataset's held-out prompts.

        An engine that a worker collecting ahead samples with is driven by that worker alone:
        evaluation runs there, on the weights published after the last update (the current ones).
        """
        started = time.perf_counter()
        with self.spans.span(step if step is not None else -1, "eval"):
            if self.ahead is not None and self.sampler is self.ahead.engine:
                metrics = self.ahead.on_worker(self._evaluate_synced)
            else:
                metrics = self._evaluate_synced(self.policy)
        return metrics | {"time/eval": time.perf_counter() - started}

    def _evaluate_synced(self, weights) -> dict[str, float]:
        """:func:`opd.runs.evaluation.evaluate` with the sampler, an engine synced to ``weights`` first."""
        if self.sampler is self.engine:
            self.engine.sync(weights)
        return evaluate(
            self.sampler,
            self.renderer,
            self.eval_sets,
            temperature=self.config.training.temperature,
            max_tokens=self.config.training.max_tokens,
            seed=self.config.seed,
            pad_id=self.sampler.pad_id,
        )

    def run(self) -> TrainResult:
        """Train from the start point ``log_path`` dictates up to ``num_steps``, checkpointing on the way.

        Every process runs this loop on its share of each batch; rank 0 alone writes the run's
        files, logs and shows progress.
        """
        log_path, main = Path(self.config.log_path), self.world.is_main
        start = resume_point(self.config)
        if start.model_dir != self.resumed_model_dir:
            raise CheckpointError(
                f"{log_path}: its checkpoints changed while the run was being set up; start it again"
            )
        if main:
            prepare_log_path(self.config)
        barrier()
        self.restore(start)
        if main:
            (log_path / CONFIG_NAME).write_text(yaml.safe_dump(recorded_config(self.config), sort_keys=False))
        result = TrainResult(self.student, self.tokenizer, self.renderer, log_path=log_path)
        if start.step >= self.num_steps:
            if main:
                tqdm.write(
                    f"{log_path}: training already complete ({start.step} steps); nothing to do",
                    file=sys.stderr,
                )
            return result
        if main:
            for name in (METRICS_NAME, SAMPLES_NAME):
                keep_metrics_before(log_path / name, start.step)
        eval_every = self.config.eval_every if self.eval_sets else 0
        names = [d.name for d in self.config.datasets]
        writer = MetricsWriter(log_path / METRICS_NAME) if main else None
        loggers = build_loggers(self.config) if main else []
        samples = JsonlWriter(log_path / SAMPLES_NAME) if main else None
        self.spans = SpanRecorder(log_path / TIMING_NAME if main else None)
        staleness = self.config.training.max_staleness
        ahead = (
            AheadCollector(
                self.collect,
                self.policy,
                self.ahead_engine,
                max_staleness=staleness,
                start_step=start.step,
                end_step=self.num_steps,
                bucket_bytes=int(self.config.student.sync_bucket_mb * 2**20),
            )
            if staleness
            else None
        )
        self.ahead = ahead
        checkpoint_seconds = None
        bar = tqdm(
            total=self.num_steps,
            initial=start.step,
            desc="opd",
            disable=not (self.progress and main),
            bar_format=PROGRESS_FORMAT,
        )

        watchdog = Watchdog()
        last_saved = start.step
        stop = StopOnSignal(
            lambda: (
                f"the run then resumes from step {last_saved}" if last_saved else "the run then starts over"
            )
        )

        def record(metrics: dict, step: int) -> None:
            if main:
                writer.write(metrics)
                for logger in loggers:
                    logger.log(metrics, step)
            result.metrics.append(metrics)
            for symptom in watchdog.check(metrics):
                if self.config.training.stop_on_divergence:
                    raise DivergenceError(
                        f"step {step}: {symptom.message}. Stopped (training.stop_on_divergence); the "
                        "last checkpoint is kept: change the setting and run again to resume from it"
                    )
                if main:
                    tqdm.write(f"opd: warning: step {step}: {symptom.message}", file=sys.stderr)

        stop.install()
        failing = False
        try:
            for step in range(start.step, self.num_steps):
                evaluation = {}
                if eval_every and step % eval_every == 0:
                    show_phase(bar, "evaluating")
                    evaluation = self.evaluate(step)
                batch = ahead.batch(step) if ahead else self.collect(step)
                if main:
                    samples.write(
                        sample_records(self.tokenizer, names, step, batch.rollouts, batch.reverse_kl_BT)
                    )
                    if self.config.training.show_examples:
                        tqdm.write(examples(self.tokenizer, names, batch.rollouts, batch.reverse_kl_BT))
                metrics = self.learn(batch) | evaluation
                if ahead:
                    metrics["time/weight_sync"] = ahead.publish(step + 1)
                if checkpoint_seconds is not None:
                    metrics["time/checkpoint"], checkpoint_seconds = checkpoint_seconds, None
                metrics["progress/done_frac"] = (step + 1) / self.num_steps
                record(metrics, step)
                bar.postfix = progress_postfix(metrics)
                bar.update(1)
                done = step + 1
                if done == self.num_steps and eval_every:
                    show_phase(bar, "evaluating")
                    record({"step": done} | self.evaluate(done), done)
                if main:
                    check_log_path(log_path, done)
                signal_number = stop.requested() if done < self.num_steps else None
                if (
                    done == self.num_steps
                    or (self.config.save_every and done % self.config.save_every == 0)
                    or signal_number
                ):
                    saving = time.perf_counter()
                    show_phase(bar, f"saving checkpoint step_{done:06d}")
                    with self.spans.span(step, "checkpoint"):
                        self.save_checkpoint(done)
                    checkpoint_seconds = time.perf_counter() - saving
                    last_saved = done
                if signal_number:
                    raise RunInterrupted(
                        f"stopped by {signal.Signals(signal_number).name} after step {done} of "
                        f"{self.num_steps}; "
                        f"checkpoint step_{done:06d} saved in {log_path / 'checkpoints'}. Run the same "
                        f"command again to resume from step {done}",
                        signal_number,
                    )
        except BaseException as error:
            failing = True
            if (full := out_of_space(error)) is not None:
                raise disk_full_error(log_path, full, last_saved) from None
            raise
        finally:
            stop.uninstall()
            if ahead:
                ahead.close()
                self.ahead = None
            bar.close()
            # after a failure (a full disk above all), a close that fails too must not hide the first error
            for handle in (writer, samples, *loggers, self.spans):
                if handle is not None:
                    with contextlib.suppress(OSError) if failing else contextlib.nullcontext():
                        handle.close()
            self.spans = SpanRecorder(None)
        if self.config.trace and main:
            write_chrome_trace(log_path / TIMING_NAME, log_path / "trace.json")
        return result

    def restore(self, start: StartPoint) -> None:
        """Put back a checkpoint's optimizer, schedule, policy version and RNG states (and its
        weights, when sharded; one-process weights were loaded before the student was sharded)."""
        if start.model_dir is None:
            return
        checkpoint = start.model_dir.parent
        if has_sharded_state(checkpoint):
            load_sharded_state(checkpoint, self.policy, self.optimizer)
        else:
            load_indexed_optimizer_state(self.policy, self.optimizer, start.trainer_state["optimizer"])
        self.scheduler.load_state_dict(start.trainer_state["scheduler"])
        self.policy.version = start.trainer_state.get("policy_version", self.scheduler.last_epoch)
        restore_rng_states(start.trainer_state["rng"])

    def save_checkpoint(self, steps_done: int) -> None:
        """Weights, optimizer, scheduler and RNG states after ``steps_done`` steps, written atomically:
        a Hugging Face model and an indexed optimizer state from one process, sharded state from
        several (:mod:`opd.runs.sharded_state`)."""
        state = {
            "scheduler": self.scheduler.state_dict(),
            "policy_version": self.policy.version,
            "world_size": self.world.size,
        }
        if self.world.size > 1:

            def save_model(directory: Path) -> None:
                save_sharded_state(directory, self.policy, self.optimizer)

        else:
            state["optimizer"] = self.optimizer.state_dict()

            def save_model(directory: Path) -> None:
                self.policy.save(directory / "model")

        save_checkpoint(Path(self.config.log_path), steps_done, save_model, self.tokenizer, state)


def train(config: Config, *, progress: bool = True) -> TrainResult:
    """Run on-policy distillation as configured; the Python twin of ``opd train``."""
    return Trainer(config, progress=progress).run()
