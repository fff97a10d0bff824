"""Checkpoints that survive a crash at any moment, and the index that finds them.

A checkpoint is written into ``checkpoints/.tmp-<name>``, every file fsynced, then renamed
to ``checkpoints/<name>`` (atomic on POSIX) and only then appended to
``<log_path>/checkpoints.jsonl``. A crash leaves either the previous checkpoint set or a
``.tmp-*`` directory that resume ignores (with a warning).

Layout of one checkpoint::

    checkpoints/step_000020/
      model/               PEFT adapter or full HF model (safetensors), with the tokenizer
      trainer_state.pt     optimizer, scheduler, RNG states, step (loaded with weights_only=True)
      checkpoint.json      name, step, written last

A run of several processes writes the weights and optimizer state sharded instead
(:mod:`opd.runs.sharded_state`): ``state/`` is a ``torch.distributed.checkpoint`` directory
(every process writes its shards), ``model/`` holds the tokenizer and the model's config, and
``trainer_state.pt`` the rest. Every process takes part in the save; rank 0 alone commits it.
"""

from __future__ import annotations

import io
import json
import os
import random
import shutil
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from opd.distributed import barrier, world
from opd.errors import CheckpointError

INDEX_NAME = "checkpoints.jsonl"
STATE_NAME = "trainer_state.pt"
MARKER_NAME = "checkpoint.json"


@dataclass(frozen=True)
class CheckpointRecord:
    """One line of the index."""

    name: str
    step: int
    path: Path


def _fsync_tree(directory: Path) -> None:
    for path in sorted(directory.rglob("*")):
        if path.is_file():
            with path.open("rb") as handle:
                os.fsync(handle.fileno())
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


class WholeWrites(io.RawIOBase):
    """A file ``torch.save`` writes through, so that a full disk raises OSError (ENOSPC) in its
    chain.

    Given a path, torch writes with C++ streams and reports a full disk as a bare RuntimeError;
    given this, every write goes through ``os.write``, retried until whole or refused.
    """

    def __init__(self, path: Path):
        super().__init__()
        self._descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        while view:
            view = view[os.write(self._descriptor, view) :]
        return len(data)

    def close(self) -> None:
        if not self.closed:
            os.close(self._descriptor)
        super().close()


def rng_states() -> dict:
    """Every RNG the run touches, in a form ``torch.load(weights_only=True)`` accepts."""
    numpy_state = np.random.get_state()
    states = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": [numpy_state[0], numpy_state[1].tolist(), *numpy_state[2:]],
    }
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def restore_rng_states(states: dict) -> None:
    """Put back what :func:`rng_states` saved."""
    torch.set_rng_state(states["torch"])
    version, *rest = states["python"]
    random.setstate((version, tuple(rest[0]), rest[1]))
    name, keys, *tail = states["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), *tail))
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


def save_checkpoint(
    log_path: Path, step: int, save_model: Callable[[Path], None], tokenizer, trainer_state: dict
) -> CheckpointRecord:
    """Write checkpoint ``step_<step>`` atomically and append it to the index.

    ``save_model(directory)`` writes the student's weights (:meth:`opd.policy.Policy.save`, or
    the sharded state; every process calls this function and ``save_model``, each writing its
    shards; only rank 0 writes the rest and commits).
    """
    root = log_path / "checkpoints"
    name = f"step_{step:06d}"
    final = root / name
    staging = root / f".tmp-{name}"
    main = world().is_main
    if main:
        root.mkdir(parents=True, exist_ok=True)
        for leftover in root.glob(".tmp-*"):  # from a crash: never indexed, only taking space
            shutil.rmtree(leftover, ignore_errors=True)
        staging.mkdir()
    barrier()
    record = CheckpointRecord(name, step, final)
    try:
        save_model(staging)
        barrier()
        if main:
            _commit(log_path, staging, record, tokenizer, trainer_state)
    except BaseException:
        if (
            main
        ):  # a save that failed (disk full, interrupted) leaves the previous checkpoints alone
            shutil.rmtree(staging, ignore_errors=True)
        raise
    barrier()
    return record


def _commit(
    log_path: Path, staging: Path, record: CheckpointRecord, tokenizer, trainer_state: dict
) -> None:
    """Finish a staged checkpoint: tokenizer, trainer state, marker; fsync; rename; index."""
    name, step, final = record.name, record.step, record.path
    tokenizer.save_pretrained(staging / "model")
    with WholeWrites(staging / STATE_NAME) as handle:
        torch.save({**trainer_state, "step": step, "rng": rng_states()}, handle)
    (staging / MARKER_NAME).write_text(json.dumps({"name": name, "step": step}))
    _fsync_tree(staging)
    if final.exists():
        shutil.rmtree(final)
    staging.rename(final)
    _fsync_tree(final.parent)
    with (log_path / INDEX_NAME).open("a", encoding="utf-8") as handle:
        handle.write(
            json.dumps({"name": name, "step": step, "path": str(final.relative_to(log_path))})
            + "\n"
        )
        handle.flush()
        os.fsync(handle.fileno())


def list_checkpoints(log_path: Path) -> list[CheckpointRecord]:
    """Indexed checkpoints whose directory is complete, oldest first; warns about leftovers."""
    root = log_path / "checkpoints"
    if root.is_dir():
        for leftover in sorted(root.glob(".tmp-*")):
            warnings.warn(
                f"ignoring half-written checkpoint {leftover} (a crash during saving)", stacklevel=2
            )
    index = log_path / INDEX_NAME
    if not index.exists():
        return []
    records: dict[str, CheckpointRecord] = {}
    for number, line in enumerate(index.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
            record = CheckpointRecord(entry["name"], int(entry["step"]), log_path / entry["path"])
        except (json.JSONDecodeError, KeyError, TypeError, ValueError):
            warnings.warn(f"{index}:{number}: unreadable index line ignored", stacklevel=2)
            continue
        if (record.path / MARKER_NAME).exists():
            records[record.name] = record
    return sorted(records.values(), key=lambda r: r.step)


def load_trainer_state(record: CheckpointRecord, older: list[CheckpointRecord]) -> dict:
    """The optimizer/scheduler/RNG state of a checkpoint, or a clear error offering an older one."""
    path = record.path / STATE_NAME
    try:
        return torch.load(path, weights_only=True, map_location="cpu")
    except Exception as error:
        raise corrupt_checkpoint_error(path, error, older) from error


def corrupt_checkpoint_error(
    path: Path, error: Exception, older: list[CheckpointRecord]
) -> CheckpointError:
    """The error for an unreadable checkpoint file, naming the next older good checkpoint."""
    offer = (
        f"The next older checkpoint is {older[-1].path} (step {older[-1].step}): remove "
        f"{path.parent} and its line in checkpoints.jsonl to resume from it."
        if older
        else "No older checkpoint exists; start again with on_existing_log_path: overwrite."
    )
    return CheckpointError(f"checkpoint file {path} is corrupt or truncated ({error}). {offer}")


def latest_model_dir(log_path: Path) -> Path:
    """The student of a run's most recent checkpoint."""
    records = list_checkpoints(log_path)
    if not records:
        raise CheckpointError(f"{log_path}: no complete checkpoint in {log_path / INDEX_NAME}")
    return records[-1].path / "model"
