"""A run's checkpoints from the trainer's side: what is saved after a step (weights, optimizer,
schedule, policy version, RNG states; sharded across processes; the weights of the batches in
collection ahead) and put back before the first step of a resumed run."""

from __future__ import annotations

from pathlib import Path

from opd.assemble.run import RunComponents
from opd.runs.checkpoints import restore_rng_states, save_checkpoint
from opd.runs.resume import StartPoint
from opd.runs.sharded_state import (
    has_sharded_state,
    load_indexed_optimizer_state,
    load_sharded_state,
    save_sharded_state,
)
from opd.trainer.ahead import AheadCollector, PublishedWeights, load_in_flight, save_in_flight


class Checkpointer:
    """Saving and restoring the trainer's state: the run's parts, and the weights of the batches
    in collection ahead (``ahead``, set by the run loop)."""

    def __init__(self, parts: RunComponents):
        self.parts = parts
        self.ahead: AheadCollector | None = None
        self.in_flight: dict[int, PublishedWeights] = {}
        """A resumed run's batches in collection at its checkpoint, with their weights
        (:meth:`restore`)."""

    def restore(self, start: StartPoint) -> None:
        """Put back a checkpoint's optimizer, schedule, policy version and RNG states (and its
        weights, when sharded; one-process weights were loaded before the student was sharded)."""
        if start.model_dir is None:
            return
        checkpoint = start.model_dir.parent
        if has_sharded_state(checkpoint):
            load_sharded_state(checkpoint, self.parts.policy, self.parts.optimizer)
        else:
            load_indexed_optimizer_state(
                self.parts.policy, self.parts.optimizer, start.trainer_state["optimizer"]
            )
        self.parts.scheduler.load_state_dict(start.trainer_state["scheduler"])
        self.parts.policy.version = start.trainer_state.get(
            "policy_version", self.parts.scheduler.last_epoch
        )
        restore_rng_states(start.trainer_state["rng"])
        self.in_flight = load_in_flight(checkpoint)

    def save(self, steps_done: int) -> None:
        """Weights, optimizer, scheduler and RNG states after ``steps_done`` steps, written
        atomically: a Hugging Face model and an indexed optimizer state from one process, sharded
        state from several (:mod:`opd.runs.sharded_state`)."""
        state = {
            "scheduler": self.parts.scheduler.state_dict(),
            "policy_version": self.parts.policy.version,
            "world_size": self.parts.world.size,
        }
        in_flight = self.ahead.in_flight() if self.ahead is not None else {}
        if self.parts.world.size > 1:

            def save_model(directory: Path) -> None:
                save_sharded_state(directory, self.parts.policy, self.parts.optimizer)
                if self.parts.world.is_main:  # every process holds the same published weights
                    save_in_flight(directory, in_flight)

        else:
            state["optimizer"] = self.parts.optimizer.state_dict()

            def save_model(directory: Path) -> None:
                self.parts.policy.save(directory / "model")
                save_in_flight(directory, in_flight)

        save_checkpoint(
            Path(self.parts.config.log_path), steps_done, save_model, self.parts.tokenizer, state
        )
