"""Per-step metrics: one JSON object per line in ``<log_path>/metrics.jsonl``."""

from __future__ import annotations

import json
import math
from pathlib import Path


def _jsonable(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class JsonlWriter:
    """Appends JSON lines and flushes them, so a crash loses at most the current step."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._handle = self.path.open("a", encoding="utf-8")

    def write(self, records: list[dict]) -> None:
        """Write each record as one line."""
        for record in records:
            self._handle.write(json.dumps(record) + "\n")
        self._handle.flush()

    def close(self) -> None:
        """Close the file."""
        self._handle.close()


class MetricsWriter(JsonlWriter):
    """One row per step in ``metrics.jsonl``; non-finite floats become null."""

    def write(self, metrics: dict) -> None:
        """Write one step's metrics."""
        super().write([{key: _jsonable(value) for key, value in metrics.items()}])


def read_jsonl(path: str | Path) -> list[dict]:
    """All records of a JSONL file a run wrote (metrics, spans, samples); empty if it is absent."""
    path = Path(path)
    if not path.exists():
        return []
    lines = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    records = []
    for number, line in enumerate(lines, start=1):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if number < len(lines):
                raise
            # the last line of a run killed (or out of disk) mid-write: that step is redone on
            # resume
    return records
