"""The run's JSONL records, written by one writer: steps, samples, timeline, weight syncs, micro-batches.

Files go to the run directory ``$AREAL_RUN_DIR`` (``areal-plugins train`` sets it in the Ray job's
environment, so every node sees it); without it nothing is written. Every process of the run (driver,
trainer workers, rollout servers) appends through :func:`append_record`, one whole line per call, so
concurrent writers never interleave lines; a process on another node than the run directory sends its
lines to the run's record sink (:mod:`areal_plugins.records.sink`).
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

from areal_plugins.records.sink import append_line, remote_sink, this_node

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
    sink = remote_sink()
    if sink is not None:
        sink.append.remote(name, line, this_node())
        return True
    with _lock:
        append_line(directory / name, line)
    return True


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The records of a JSONL file written by a run (none when it does not exist)."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def record_exists(name: str, directory: Path | None = None) -> bool:
    """Whether the run directory holds ``name`` (asked of the sink from another node)."""
    directory = directory if directory is not None else run_dir()
    if directory is None:
        return False
    sink = remote_sink()
    if sink is not None:
        import ray

        return bool(ray.get(sink.exists.remote(name)))
    return (directory / name).exists()


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
