"""The run's JSONL records, written by one writer: steps, samples, timeline, weight syncs, micro-batches.

Files go to the run directory ``$AREAL_RUN_DIR`` (``areal-plugins train`` sets it); without it
nothing is written. Every process of the run (driver, trainer workers, rollout servers) appends
through :func:`append_record`, one whole line per call, so concurrent writers never interleave lines.
``timeline.jsonl`` holds spans ``{"who", "what", "start", "end"}`` (trainer waiting / training /
updating weights) and rollout samples ``{"who": "rollout", "time", "busy_s", "in_flight"}``.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

RUN_DIR_ENV = "AREAL_RUN_DIR"
_lock = threading.Lock()


def run_dir() -> Path | None:
    """This run's directory, or None when the run writes no records."""
    value = os.environ.get(RUN_DIR_ENV)
    return Path(value) if value else None


def append_record(name: str, record: dict[str, Any], directory: Path | None = None) -> bool:
    """Append ``record`` as one JSON line to ``name`` in the run directory; False when there is none."""
    directory = directory if directory is not None else run_dir()
    if directory is None:
        return False
    line = json.dumps(record, default=float) + "\n"
    with _lock:
        # One write() of the whole line with O_APPEND: lines of several processes do not interleave.
        fd = os.open(directory / name, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)
    return True


class RunRecorder:
    """The driver's handle on the records: :meth:`write` and timeline :meth:`span`."""

    def __init__(self, directory: str | None = None) -> None:
        self.run_dir = Path(directory) if directory else run_dir()

    def write(self, name: str, record: dict[str, Any]) -> None:
        if self.run_dir is not None:
            append_record(name, record, self.run_dir)

    @contextmanager
    def span(self, who: str, what: str, **extra: Any) -> Iterator[float]:
        """Record how long the block took as a timeline span; yields the start time."""
        start = time.time()
        try:
            yield start
        finally:
            self.write("timeline.jsonl", {"who": who, "what": what, "start": start, "end": time.time(), **extra})
