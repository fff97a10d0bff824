"""When a run's files stop being written: a full disk (or quota, or file size limit), or its
directory removed under it. Both stop the run with one line saying what was kept."""

from __future__ import annotations

import errno
from pathlib import Path

from opd.errors import StorageError
from opd.runs.resume import CONFIG_NAME

DISK_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
"""OSErrors that mean the run's files no longer fit: out of space, over quota, over a file size
limit."""
DISK_FULL_MESSAGES = (
    "No space left on device",
    "os error 28",
    "Disk quota exceeded",
    "File too large",
)
"""The same, as libraries that wrap the OSError word it (safetensors)."""


def out_of_space(error: BaseException) -> Exception | None:
    """The error in ``error``'s chain that says the run's files no longer fit, or None.

    Libraries re-raise a failed write as their own exception (torch.save: RuntimeError) with the
    OSError as its context, so the whole chain is searched.
    """
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen and not isinstance(current, StorageError):
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno in DISK_FULL:
            return current
        if isinstance(current, Exception) and any(
            marker in str(current) for marker in DISK_FULL_MESSAGES
        ):
            return current
        current = current.__cause__ or current.__context__
    return None


def disk_full_error(log_path: Path, error: Exception, last_saved: int) -> StorageError:
    """What a run says when its files stop fitting: where, and what it kept."""
    kept = (
        f"the last complete checkpoint is step {last_saved}"
        if last_saved
        else "no checkpoint was saved"
    )
    detail = (
        f"{error.strerror}: {error.filename}" if isinstance(error, OSError) else str(error)[:200]
    )
    return StorageError(
        f"{log_path}: no space left for the run's files ({detail}); {kept}. Free space (or set "
        "log_path elsewhere) and run the same command again to resume"
    )


def check_log_path(log_path: Path, done: int) -> None:
    """Stop when the run's directory was removed under it: what it writes next would go nowhere."""
    if not (log_path / CONFIG_NAME).is_file():
        raise StorageError(
            f"{log_path}: the run's directory (or its {CONFIG_NAME}) was removed during the run; "
            f"stopped after step {done}, nothing more saved. Run the same command again: it "
            "resumes from a surviving checkpoint, or starts over"
        )
