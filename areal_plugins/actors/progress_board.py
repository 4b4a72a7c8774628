"""Progress counters the stall guard reads while the trainer computes (docs/faults.md, A trainer worker hangs).

A step of a large run computes for tens of minutes (old log-probs and the update over millions of tokens);
elapsed time says nothing about whether it is hung. Work that moves does: the trainer workers count the
micro-batches they start (``patches/trainer_progress.py``), the engines the tokens they generate
(:mod:`areal_plugins.driver.engine_stats`), the driver the phases it finishes. Each process adds to its own
counter and sends the running total to :class:`ProgressBoard`, a named Ray actor of the run, at most once per
:data:`REPORT_INTERVAL_S`; the stall guard reads the board's totals on each look (one call every few seconds).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

logger = logging.getLogger(__name__)

BOARD_NAME = "areal_progress_board"
#: Seconds between two reports of one process: the board hears of progress at most this late, far inside any
#: stall limit (``areal.watchdog_s``), and a micro-batch loop sends at most one call a second.
REPORT_INTERVAL_S = 1.0
#: Seconds between two looks for the board by a process that found none (workers may start before it).
LOOKUP_INTERVAL_S = 5.0


class ProgressBoard:
    """Running totals per source (``trainer_micro_batches``, ...), each summed over the processes reporting it."""

    def __init__(self) -> None:
        self._totals: dict[tuple[str, str], int] = {}  # (kind, process) -> its running total

    def report(self, kind: str, process: str, total: int) -> None:
        self._totals[(kind, process)] = max(total, self._totals.get((kind, process), 0))

    def totals(self) -> dict[str, int]:
        summed: dict[str, int] = {}
        for (kind, _), total in self._totals.items():
            summed[kind] = summed.get(kind, 0) + total
        return summed


def start_progress_board() -> Any:
    """Start (or find) the run's board; its handle."""
    import ray

    return ray.remote(ProgressBoard).options(name=BOARD_NAME, get_if_exists=True, num_cpus=0).remote()


class ProgressReporter:
    """One process's counters and their throttled reports to the board (``send`` is the board's ``report``)."""

    def __init__(self, clock: Any = time.monotonic) -> None:
        self.clock = clock
        self.counts: dict[str, int] = {}
        self._sent: dict[str, float] = {}
        self._looked = -float("inf")
        self._board: Any = None
        self._lock = threading.Lock()
        self.process = f"{os.uname().nodename}:{os.getpid()}"

    def bump(self, kind: str, count: int = 1) -> None:
        """Count ``count`` more units of ``kind``; report the total if the last report is old enough."""
        with self._lock:
            self.counts[kind] = self.counts.get(kind, 0) + count
            now = self.clock()
            if now - self._sent.get(kind, -float("inf")) < REPORT_INTERVAL_S:
                return
            board = self._find_board(now)
            if board is None:
                return
            self._sent[kind] = now
            total = self.counts[kind]
        try:
            board.report.remote(kind, self.process, total)
        except Exception as error:  # progress is evidence for the guard, never a reason to fail the work
            logger.debug("progress report failed: %r", error)

    def _find_board(self, now: float) -> Any:
        if self._board is not None or now - self._looked < LOOKUP_INTERVAL_S:
            return self._board
        self._looked = now
        try:
            import ray

            if ray.is_initialized():
                self._board = ray.get_actor(BOARD_NAME)
        except Exception:  # not in a Ray job, or the trainer has not started the board (yet)
            self._board = None
        return self._board


_reporter = ProgressReporter()


def report_progress(kind: str, count: int = 1) -> None:
    """Tell the run's stall guard that ``count`` units of work of ``kind`` were done in this process."""
    _reporter.bump(kind, count)
