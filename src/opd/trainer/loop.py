"""The run loop, the third room: for each step, evaluate when due, collect the batch (or take it
from the worker collecting ahead), learn from it, log, checkpoint when due, as the reference's
synchronous loop does. The step's two halves live in their own rooms: collection
(:mod:`opd.trainer.collect`: sample, play episodes, score) and learning (:mod:`opd.trainer.learn`:
advantages, the update); what a run is built from is assembled by :mod:`opd.assemble.run`,
and its checkpoints are saved and restored by :mod:`opd.trainer.checkpointing`.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import yaml
from tqdm.auto import tqdm

from opd.assemble.run import assemble_run
from opd.config import Config, recorded_config
from opd.data.render import ChatRenderer
from opd.distributed import barrier
from opd.errors import (
    CheckpointError,
    DivergenceError,
    RemoteTeacherError,
    RolloutServerError,
    RunInterrupted,
)
from opd.runs.display import (
    PROGRESS_FORMAT,
    examples,
    progress_postfix,
    sample_records,
    show_phase,
)
from opd.runs.evaluation import evaluate
from opd.runs.loggers import build_loggers
from opd.runs.metrics import JsonlWriter, MetricsWriter, read_jsonl
from opd.runs.resume import (
    CONFIG_NAME,
    METRICS_NAME,
    SAMPLES_NAME,
    TIMING_NAME,
    keep_metrics_before,
    prepare_log_path,
    resume_point,
)
from opd.runs.storage import check_log_path, disk_full_error, out_of_space
from opd.runs.timing import SpanRecorder, write_chrome_trace
from opd.runs.watchdog import Watchdog
from opd.trainer.ahead import AheadCollector
from opd.trainer.batch import Batch
from opd.trainer.checkpointing import Checkpointer
from opd.trainer.collect import Collector
from opd.trainer.learn import Learner
from opd.trainer.stopping import StopOnSignal


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
            raise KeyError(
                f"{key!r}: not a metric of the run in {self.log_path}; it logged {known}"
            )
        return values[-1]


class Trainer:
    """One run: its parts (:class:`RunComponents`, built by :func:`assemble_run`), the three that
    act on them (a :class:`Collector` makes a step's batch, a :class:`Learner` learns from it, a
    :class:`Checkpointer` saves and restores), and the loop."""

    def __init__(self, config: Config, *, progress: bool = True):
        self.parts = assemble_run(config)
        self.progress = progress
        self.collector = Collector(self.parts)
        self.learner = Learner(self.parts)
        self.checkpointer = Checkpointer(self.parts)
        self.spans = SpanRecorder(None)
        self.ahead: AheadCollector | None = None
        """The worker collecting ahead, while :meth:`run` runs with ``max_staleness`` > 0."""

    @property
    def spans(self) -> SpanRecorder:
        """Where each phase's time is recorded: the run's timing file while :meth:`run` runs."""
        return self._spans

    @spans.setter
    def spans(self, recorder: SpanRecorder) -> None:
        self._spans = self.collector.spans = self.learner.spans = recorder

    def collect(self, step: int, engine=None) -> Batch:
        """Step ``step``'s batch (this process's share), sampled and scored (:class:`Collector`)."""
        return self.collector.collect(step, engine)

    def learn(self, batch: Batch) -> dict[str, float]:
        """Advantages and the update from ``batch``; the step's metrics (:class:`Learner`)."""
        return self.learner.learn(batch)

    def train_step(self, step: int) -> dict[str, float]:
        """One step as the reference takes it: collect, then learn; the step's metrics."""
        return self.learn(self.collect(step))

    def save_checkpoint(self, steps_done: int) -> None:
        self.checkpointer.ahead = self.ahead
        self.checkpointer.save(steps_done)

    def evaluate(self, step: int | None = None) -> dict[str, float]:
        """``test/*`` metrics of the current student on every dataset's held-out prompts.

        An engine that a worker collecting ahead samples with is driven by that worker alone:
        evaluation runs there, on the weights published after the last update (the current ones).
        """
        started = time.perf_counter()
        with self.spans.span(step if step is not None else -1, "eval"):
            if self.ahead is not None and self.parts.sampler is self.ahead.engine:
                metrics = self.ahead.on_worker(self._evaluate_synced)
            else:
                metrics = self._evaluate_synced(self.parts.policy)
        return metrics | {"time/eval": time.perf_counter() - started}

    def _evaluate_synced(self, weights) -> dict[str, float]:
        """:func:`opd.runs.evaluation.evaluate` with the sampler, an engine synced to ``weights``
        first."""
        if self.parts.sampler is self.parts.engine:
            self.parts.engine.sync(weights)
        return evaluate(
            self.parts.sampler,
            self.parts.renderer,
            self.parts.eval_sets,
            temperature=self.parts.config.training.temperature,
            max_tokens=self.parts.config.training.max_tokens,
            seed=self.parts.config.seed,
            pad_id=self.parts.sampler.pad_id,
        )

    def run(self) -> TrainResult:
        """Train from the start point ``log_path`` dictates up to ``num_steps``, checkpointing on
        the way.

        Every process runs this loop on its share of each batch; rank 0 alone writes the run's
        files, logs and shows progress.
        """
        log_path, main = Path(self.parts.config.log_path), self.parts.world.is_main
        start = resume_point(self.parts.config)
        if start.model_dir != self.parts.resumed_model_dir:
            raise CheckpointError(
                f"{log_path}: its checkpoints changed while the run was being set up; start it "
                "again"
            )
        if main:
            prepare_log_path(self.parts.config)
        barrier()
        self.checkpointer.restore(start)
        if main:
            (log_path / CONFIG_NAME).write_text(
                yaml.safe_dump(recorded_config(self.parts.config), sort_keys=False)
            )
        result = TrainResult(
            self.parts.student, self.parts.tokenizer, self.parts.renderer, log_path=log_path
        )
        if start.step >= self.parts.num_steps:
            if main:
                tqdm.write(
                    f"{log_path}: training already complete ({start.step} steps); nothing to do",
                    file=sys.stderr,
                )
            return result
        if main:
            for name in (METRICS_NAME, SAMPLES_NAME):
                keep_metrics_before(log_path / name, start.step)
        eval_every = self.parts.config.eval_every if self.parts.eval_sets else 0
        names = [d.name for d in self.parts.config.datasets]
        writer = MetricsWriter(log_path / METRICS_NAME) if main else None
        loggers = build_loggers(self.parts.config) if main else []
        samples = JsonlWriter(log_path / SAMPLES_NAME) if main else None
        self.spans = SpanRecorder(log_path / TIMING_NAME if main else None)
        staleness = self.parts.config.training.max_staleness
        ahead = (
            AheadCollector(
                self.collect,
                self.parts.policy,
                self.parts.ahead_engine,
                max_staleness=staleness,
                start_step=start.step,
                end_step=self.parts.num_steps,
                bucket_bytes=int(self.parts.config.student.sync_bucket_mb * 2**20),
                in_flight=self.checkpointer.in_flight,
            )
            if staleness
            else None
        )
        self.ahead = ahead
        checkpoint_seconds = None
        bar = tqdm(
            total=self.parts.num_steps,
            initial=start.step,
            desc="opd",
            disable=not (self.progress and main),
            bar_format=PROGRESS_FORMAT,
        )

        watchdog = Watchdog(self.parts.config)
        last_saved = start.step
        stop = StopOnSignal(
            lambda: (
                f"the run then resumes from step {last_saved}"
                if last_saved
                else "the run then starts over"
            )
        )

        def record(metrics: dict, step: int) -> None:
            if main:
                writer.write(metrics)
                for logger in loggers:
                    logger.log(metrics, step)
            result.metrics.append(metrics)
            for symptom in watchdog.check(metrics):
                if self.parts.config.training.stop_on_divergence:
                    raise DivergenceError(
                        f"step {step}: {symptom.message}. Stopped (training.stop_on_divergence); "
                        "the last checkpoint is kept: change the setting and run again to resume "
                        "from it"
                    )
                if main:
                    tqdm.write(f"opd: warning: step {step}: {symptom.message}", file=sys.stderr)

        stop.install()
        failing = False
        try:
            for step in range(start.step, self.parts.num_steps):
                evaluation = {}
                if eval_every and step % eval_every == 0:
                    show_phase(bar, "evaluating")
                    evaluation = self.evaluate(step)
                batch = ahead.batch(step) if ahead else self.collect(step)
                if main:
                    samples.write(
                        sample_records(
                            self.parts.tokenizer, names, step, batch.rollouts, batch.reverse_kl_BT
                        )
                    )
                    if self.parts.config.training.show_examples:
                        tqdm.write(
                            examples(
                                self.parts.tokenizer, names, batch.rollouts, batch.reverse_kl_BT
                            )
                        )
                metrics = self.learn(batch) | evaluation
                if ahead:
                    metrics["time/weight_sync"] = ahead.publish(step + 1)
                if checkpoint_seconds is not None:
                    metrics["time/checkpoint"], checkpoint_seconds = checkpoint_seconds, None
                metrics["progress/done_frac"] = (step + 1) / self.parts.num_steps
                record(metrics, step)
                bar.postfix = progress_postfix(metrics)
                bar.update(1)
                done = step + 1
                if done == self.parts.num_steps and eval_every:
                    show_phase(bar, "evaluating")
                    record({"step": done} | self.evaluate(done), done)
                if main:
                    check_log_path(log_path, done)
                signal_number = stop.requested() if done < self.parts.num_steps else None
                if (
                    done == self.parts.num_steps
                    or (self.parts.config.save_every and done % self.parts.config.save_every == 0)
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
                        f"{self.parts.num_steps}; checkpoint step_{done:06d} saved in "
                        f"{log_path / 'checkpoints'}. Run the same command again to resume from "
                        f"step {done}",
                        signal_number,
                    )
        except BaseException as error:
            failing = True
            if (full := out_of_space(error)) is not None:
                raise disk_full_error(log_path, full, last_saved) from None
            if isinstance(error, RemoteTeacherError | RolloutServerError):  # a server lost mid-run
                again = (
                    f"resumes from step {last_saved}"
                    if last_saved
                    else "starts over (no checkpoint yet)"
                )
                raise type(error)(f"{error}. Run the same command again: the run {again}") from None
            raise
        finally:
            stop.uninstall()
            if ahead:
                ahead.close()
                self.ahead = None
            bar.close()
            # after a failure (a full disk above all), a close that fails too must not hide the
            # first error
            for handle in (writer, samples, *loggers, self.spans):
                if handle is not None:
                    with contextlib.suppress(OSError) if failing else contextlib.nullcontext():
                        handle.close()
            self.spans = SpanRecorder(None)
        if self.parts.config.trace and main:
            write_chrome_trace(log_path / TIMING_NAME, log_path / "trace.json")
        return result


def train(config: Config, *, progress: bool = True) -> TrainResult:
    """Run on-policy distillation as configured; the Python twin of ``opd train``."""
    return Trainer(config, progress=progress).run()
