"""JSONL records of an async run, for plots and for tests: steps, consumed samples, a timeline.

Files go to ``$AREAL_RUN_DIR`` (set by ``areal-plugins train``); without it nothing is written.
``timeline.jsonl`` holds spans ``{"who", "what", "start", "end"}`` (trainer waiting / training /
updating weights) and rollout samples ``{"who": "rollout", "time", "busy_s", "in_flight"}``.
"""

from __future__ import annotations

import json
import os
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any


class RunRecorder:
    """Appends JSON lines to files in the run directory (thread-safe)."""

    def __init__(self, run_dir: str | None = None) -> None:
        run_dir = run_dir if run_dir is not None else os.environ.get("AREAL_RUN_DIR")
        self.run_dir = Path(run_dir) if run_dir else None
        self._lock = threading.Lock()

    def write(self, name: str, record: dict[str, Any]) -> None:
        if self.run_dir is None:
            return
        line = json.dumps(record, default=float) + "\n"
        with self._lock, open(self.run_dir / name, "a") as handle:
            handle.write(line)

    @contextmanager
    def span(self, who: str, what: str, **extra: Any):
        """Record how long the block took as a timeline span; yields the start time."""
        start = time.time()
        try:
            yield start
        finally:
            self.write("timeline.jsonl", {"who": who, "what": what, "start": start, "end": time.time(), **extra})
