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
    with path.open(encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]
