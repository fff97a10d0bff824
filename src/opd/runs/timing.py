"""Where the time goes: spans of every phase, as JSONL and as a Chrome / Perfetto trace."""

from __future__ import annotations

import json
import threading
import time
from contextlib import contextmanager
from pathlib import Path

from opd.runs.metrics import read_jsonl


class SpanRecorder:
    """Appends ``{step, name, start, end}`` (seconds since the epoch) to ``timing.jsonl``.

    With no path it records nothing (a trainer used outside :meth:`Trainer.run`, or a process
    other than rank 0). Spans may end on several threads (a worker collecting ahead).
    """

    def __init__(self, path: str | Path | None):
        self._handle = None
        self._lock = threading.Lock()
        if path is not None:
            # held open for the whole run, closed by close()
            self._handle = Path(path).open("a", encoding="utf-8")  # noqa: SIM115

    @contextmanager
    def span(self, step: int, name: str):
        """Time the enclosed block as phase ``name`` of step ``step``."""
        start = time.time()
        try:
            yield
        finally:
            if self._handle is not None:
                record = {"step": step, "name": name, "start": start, "end": time.time()}
                with self._lock:
                    self._handle.write(json.dumps(record) + "\n")
                    self._handle.flush()

    def close(self) -> None:
        """Close the file."""
        if self._handle is not None:
            self._handle.close()


def chrome_trace(spans: list[dict]) -> dict:
    """The Trace Event Format that chrome://tracing and ui.perfetto.dev open: one row per phase."""
    if not spans:
        return {"traceEvents": []}
    origin = min(span["start"] for span in spans)
    phases = sorted({span["name"] for span in spans})
    events = [
        {
            "ph": "M",
            "name": "thread_name",
            "pid": 0,
            "tid": phases.index(name),
            "args": {"name": name},
        }
        for name in phases
    ]
    for span in spans:
        events.append(
            {
                "name": span["name"],
                "cat": "opd",
                "ph": "X",
                "pid": 0,
                "tid": phases.index(span["name"]),
                "ts": (span["start"] - origin) * 1e6,
                "dur": (span["end"] - span["start"]) * 1e6,
                "args": {"step": span["step"]},
            }
        )
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_chrome_trace(spans_path: str | Path, out: str | Path) -> Path:
    """Convert a run's ``timing.jsonl`` into ``out`` (JSON)."""
    out = Path(out)
    out.write_text(json.dumps(chrome_trace(read_jsonl(spans_path))))
    return out
