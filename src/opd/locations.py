"""Checks of the settings that name a place (a model path, a device, a server URL), light enough to
run when a config is read, so a typo is named with the config file before any model loads."""

from __future__ import annotations

import difflib
import re
import urllib.parse
from pathlib import Path

DEVICE = re.compile(r"(auto|cpu|mps|meta|(cuda|xpu|npu|hpu)(:\d+)?)")
"""What ``device`` fields accept: ``auto``, or a torch device type, with an index where it takes
one."""


def _exists(path: Path) -> bool:
    """Whether ``path`` exists; a name the system cannot even look up (too long, a NUL byte) does
    not."""
    try:
        return path.exists()
    except (OSError, ValueError):
        return False


def looks_local(name: str) -> bool:
    """A path rather than a hub id (``org/name``): it starts like a path, exists, or has two
    slashes."""
    return (
        name.startswith((".", "/", "~")) or _exists(Path(name).expanduser()) or name.count("/") > 1
    )


def missing_path_problem(name: str) -> str | None:
    """None when ``name`` is a hub id or an existing path; else what is wrong, with a close match
    from the same directory where there is one."""
    path = Path(name).expanduser()
    if not looks_local(name) or _exists(path):
        return None
    if len(path.name) > 255 or "\x00" in name:
        return f"path '{name[:60]}...' ({len(name)} characters) is not a name this system can have"
    parent = path.parent
    if not parent.is_dir():
        return f"path '{name}' does not exist (nor does its directory '{parent}')"
    siblings = sorted(entry.name for entry in parent.iterdir())
    close = difflib.get_close_matches(path.name, siblings, n=1, cutoff=0.6)
    hint = f"; did you mean '{parent / close[0]}'?" if close else ""
    return f"path '{name}' does not exist{hint}"


def device_problem(device: str) -> str | None:
    """None for a device torch can name; else what the field accepts."""
    if DEVICE.fullmatch(device):
        return None
    return f"'{device}' is not a device; use auto, cpu, cuda, cuda:N or mps"


def url_problem(url: str) -> str | None:
    """None for an http(s) URL with a host; else what is wrong with it."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return f"'{url}' is not an http(s) URL with a host (e.g. http://127.0.0.1:8000/v1)"
    try:
        parts.port  # noqa: B018 (raises on a port that is not a number)
    except ValueError:
        return f"'{url}' has a port that is not a number"
    return None
