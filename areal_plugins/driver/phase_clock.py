"""How long each phase of a step took, kept for the CLI's Ctrl-C (cli/control.py waits that long for the stop).

The async trainer says when a phase ends (:meth:`PhaseClock.end`) or times one whole (:meth:`PhaseClock.timed`);
the longest of each is written to ``areal_phase_times.jsonl`` whenever it grows (records/control_files.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from areal_plugins.records.control_files import PHASE_TIMES_FILE, PhaseTimes


class PhaseClock:
    """The phases' longest times for one run.

    Args:
        watchdog_s: ``areal.watchdog_s``, what stands in for a phase not measured yet.
        recorder: the run's :class:`~areal_plugins.records.writer.RunRecorder`.
        clock: seconds, monotonic (injected for tests).
    """

    def __init__(self, watchdog_s: float, recorder: Any, clock: Callable[[], float] = time.monotonic) -> None:
        self.times = PhaseTimes(watchdog_s)
        self._recorder = recorder
        self._clock = clock
        self._started = clock()
        self._write()

    def end(self, phase: str) -> None:
        """``phase`` ended now: measure it since the last end (or :meth:`restart`); the next one starts now."""
        now = self._clock()
        self.measure(phase, now - self._started)
        self._started = now

    def restart(self) -> None:
        """The next phase starts now; what ran since the last end is no phase to measure (the batch wait)."""
        self._started = self._clock()

    @contextmanager
    def timed(self, phase: str) -> Iterator[None]:
        """Measure the block as ``phase`` (validation, a checkpoint), apart from the step's phases."""
        started = self._clock()
        yield
        self.measure(phase, self._clock() - started)

    def measure(self, phase: str, seconds: float) -> None:
        """One measurement of ``phase``; written when it is the longest so far."""
        if self.times.measured(phase, seconds):
            self._write()

    def _write(self) -> None:
        self._recorder.write(PHASE_TIMES_FILE, self.times.record())
