"""Collection ahead of learning (``training.max_staleness: k``): a worker thread samples and scores
the batches of steps i+1..i+k while step i learns.

The worker never reads the weights being updated: after every update the trainer publishes a
copy of the student's sampler weights (:class:`PublishedWeights`, taken on the main thread, so
that under FSDP the gather is a collective every process enters together), and each batch is
sampled from the copy that was current when it was handed to the worker. Which weights a batch
gets depends only on the step numbers, never on thread timing, so a run is reproducible: step
j's batch comes from the weights after step ``max(start, j - k) - 1``. Its staleness (``j`` minus
that step + 1) is at most k; a batch older than k would be dropped and collected again.

A checkpoint keeps the weights its batches in collection were handed (:func:`save_in_flight`: at
most k versions, older than the checkpoint's own), and a resumed run hands the same steps the same
weights again (:func:`load_in_flight`), so it collects what the uninterrupted run collected.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import torch
from safetensors.torch import load_file, save_file

from opd.sampling.base import RolloutEngine
from opd.trainer.batch import Batch

if TYPE_CHECKING:
    from opd.policy.policy import Policy

T = TypeVar("T")


@dataclass(frozen=True)
class PublishedWeights:
    """The student's sampler weights after an update, as the worker samples them; never changed."""

    version: int
    """The policy version they are."""
    step: int
    """The first step they can sample for: the updates of steps before it are in them."""
    weights: dict[str, torch.Tensor]

    def sampler_weights(self, dtype: torch.dtype):
        """``(name, tensor)`` in ``dtype``, as :meth:`opd.policy.Policy.sampler_weights` gives
        them."""
        return ((name, tensor.to(dtype)) for name, tensor in self.weights.items())


Collect = Callable[[int, RolloutEngine], Batch]
"""Collects step ``i``'s batch with the given engine, already synced (the loop's ``collect``)."""


class AheadCollector:
    """Hands out step ``i``'s batch, keeping the batches of steps up to ``i + max_staleness`` in
    collection on one worker thread, which drives ``engine`` (a sampling copy of the student made
    before it was sharded, or a vLLM engine or servers that take published weights) and calls
    ``collect`` with it: the collector knows the policy and the engine, never the loop."""

    def __init__(
        self,
        collect: Collect,
        policy: Policy,
        engine: RolloutEngine,
        *,
        max_staleness: int,
        start_step: int,
        end_step: int,
        bucket_bytes: int,
        in_flight: dict[int, PublishedWeights] | None = None,
    ):
        """``in_flight``: a resumed run's batches in collection when its checkpoint was saved,
        each with the weights it was handed (:func:`load_in_flight`); they are collected first."""
        self.collect = collect
        self.policy = policy
        self.max_staleness = max_staleness
        self.end_step = end_step
        self.engine = engine
        self.dtype = engine.dtype
        self.bucket_bytes = bucket_bytes
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="opd-collect")
        self.pending: dict[int, tuple[PublishedWeights, Future]] = {}
        self.published = self._take(start_step)
        for step, weights in sorted((in_flight or {}).items()):
            if start_step <= step < min(start_step + max_staleness + 1, end_step):
                self.pending[step] = (weights, self.executor.submit(self._collect, step, weights))

    def in_flight(self) -> dict[int, PublishedWeights]:
        """The steps handed to the worker and not yet taken, each with the weights it samples."""
        return {step: weights for step, (weights, _) in self.pending.items()}

    def _take(self, step: int) -> PublishedWeights:
        with torch.no_grad():
            weights = {
                name: tensor.clone()
                for name, tensor in self.policy.streamed_sampler_weights(
                    self.dtype, self.bucket_bytes
                )
            }
        return PublishedWeights(self.policy.version, step, weights)

    def publish(self, next_step: int) -> float:
        """Publish the weights after an update, for the batches handed out from now; seconds
        taken."""
        started = time.perf_counter()
        self.published = self._take(next_step)
        return time.perf_counter() - started

    def _collect(self, step: int, weights: PublishedWeights) -> Batch:
        self.engine.sync(weights)
        return self.collect(step, self.engine)

    def _submit(self, step: int) -> None:
        weights = self.published
        self.pending[step] = (weights, self.executor.submit(self._collect, step, weights))

    def batch(self, step: int) -> Batch:
        """Step ``step``'s batch, with ``staleness`` and ``time/wait_for_batch`` set."""
        for ahead in range(step, min(step + self.max_staleness + 1, self.end_step)):
            if ahead not in self.pending:
                self._submit(ahead)
        weights, future = self.pending.pop(step)
        started = time.perf_counter()
        batch = future.result()
        waited = time.perf_counter() - started
        staleness = step - weights.step
        if staleness > self.max_staleness:
            self._submit(step)
            weights, future = self.pending.pop(step)
            batch, staleness = future.result(), step - weights.step
        batch.staleness = staleness
        batch.seconds["time/wait_for_batch"] = waited
        return batch

    def on_worker(self, task: Callable[[PublishedWeights], T]) -> T:
        """``task(published weights)`` run on the worker thread, after the batches handed to it
        (evaluation with an engine the worker samples with: one thread drives it)."""
        return self.executor.submit(task, self.published).result()

    def close(self) -> None:
        """Stop the worker, dropping batches not yet started."""
        self.executor.shutdown(wait=True, cancel_futures=True)


IN_FLIGHT = "in_flight"
"""A checkpoint's directory of the weights its batches in collection were handed."""


def save_in_flight(checkpoint: Path, in_flight: dict[int, PublishedWeights]) -> None:
    """Write each distinct version of ``in_flight``'s weights once (safetensors) and which steps
    sample which (``in_flight/steps.json``), into a checkpoint being staged."""
    if not in_flight:
        return
    directory = checkpoint / IN_FLIGHT
    directory.mkdir()
    versions: dict[str, dict] = {}
    for weights in in_flight.values():
        name = f"v{weights.version}-from{weights.step}"
        if name not in versions:
            save_file(
                {k: t.contiguous() for k, t in weights.weights.items()},
                str(directory / f"{name}.safetensors"),
            )
            versions[name] = {"version": weights.version, "step": weights.step}
    steps = {str(step): f"v{w.version}-from{w.step}" for step, w in sorted(in_flight.items())}
    (directory / "steps.json").write_text(
        json.dumps({"versions": versions, "steps": steps}, indent=1)
    )


def load_in_flight(checkpoint: Path) -> dict[int, PublishedWeights]:
    """The batches in collection when ``checkpoint`` was saved, each with its weights (none when
    the run collected synchronously, or its checkpoint predates this record)."""
    index = checkpoint / IN_FLIGHT / "steps.json"
    if not index.is_file():
        return {}
    record = json.loads(index.read_text())
    versions = {
        name: PublishedWeights(
            meta["version"], meta["step"], load_file(str(index.parent / f"{name}.safetensors"))
        )
        for name, meta in record["versions"].items()
    }
    return {int(step): versions[name] for step, name in record["steps"].items()}
