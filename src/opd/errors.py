"""The errors a user's mistake raises: each message names the field, file or server at fault.

They live here, below every other module, so that the command line can catch them without
importing torch or transformers, and any layer can raise them.
"""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration problem, with the dotted path of the offending field in the message."""


class DataError(ValueError):
    """A problem in a prompt source, naming the file and line."""


class ModelLoadError(RuntimeError):
    """A model or tokenizer could not be loaded; the message names the config field."""


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message names the file and what to do."""


class RemoteTeacherError(RuntimeError):
    """The teacher server could not give usable log-probs; the message names it."""


class RolloutServerError(RuntimeError):
    """A rollout server that cannot be used, or failed mid-run; the message names it and what to do.

    ``fault``: how the server failed, when another may take its rows: ``"silent"`` (unreachable,
    no answer in time), ``"answer"`` (HTTP 5xx, an answer that is not JSON), ``"weights"`` (other
    weights than the run's); None: it refused the request itself.
    """

    def __init__(self, message: str, fault: str | None = None):
        super().__init__(message)
        self.fault = fault


class EpisodeError(RuntimeError):
    """An environment that answered a turn with something opd cannot use; names the dataset and
    step."""


class DivergenceError(RuntimeError):
    """A run stopped by ``training.stop_on_divergence``; the message names the symptom and the
    fix."""


class StorageError(OSError):
    """A run's files could not be written (disk full, directory removed); the message says what was
    kept."""


class RunInterrupted(Exception):
    """SIGTERM or SIGINT stopped a run after a step and a checkpoint; the message says where it
    resumes."""

    def __init__(self, message: str, signal_number: int):
        super().__init__(message)
        self.signal_number = signal_number


USER_ERRORS = (
    ConfigError,
    DataError,
    ModelLoadError,
    CheckpointError,
    RemoteTeacherError,
    RolloutServerError,
    EpisodeError,
    DivergenceError,
    StorageError,
    FileNotFoundError,
)
"""What the command line reports as one line and exit status 2 instead of a traceback."""
