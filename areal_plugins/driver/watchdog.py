"""The trainer's watchdog: a wait that sees no progress for ``areal.watchdog_s`` stops the run with a report."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

logger = logging.getLogger(__name__)

#: Seconds between looks at the progress marker (each look may ask the engines for statistics).
CHECK_INTERVAL_S = 1.0


class Watchdog:
    """Raises once ``marker()`` has not changed for ``limit_s`` seconds."""

    def __init__(self, limit_s: float) -> None:
        self.limit_s = limit_s
        self.marker: Any = None  # the last progress read
        self._since = time.monotonic()
        self._started = self._since

    def check(self, marker: Callable[[], Any], report: Callable[[float], str]) -> None:
        now = time.monotonic()
        if now - self._started < CHECK_INTERVAL_S:  # no statistics calls on every fast wait
            return
        current = marker()
        if current != self.marker:
            self.marker, self._since = current, now
        elif now - self._since > self.limit_s:
            raise TimeoutError(report(now - self._since))


class TrainerStalledError(RuntimeError):
    """The stall guard stopped the run: no work moved for the guard's limit while the trainer computed."""


class StallGuard:
    """Stops the run when the trainer is away from its batch wait and nothing moves (a hung trainer worker).

    The wait beats it on every look; between two waits the trainer computes (old log-probs, update, weight
    sync), which may take tens of minutes on a large model. A step is judged by its progress, not its length:
    ``progress()`` returns a marker (trainer workers' micro-batches, the engines' generated tokens, phases
    finished: actors/progress_board.py) and any change of it counts like a beat. A worker that hangs never
    returns, so nothing in the trainer's own thread can notice: this thread logs the report and stops the run
    through ``stop`` (by default: KeyboardInterrupt in the trainer's thread, then, if that does not end it
    within ``grace_s``, the process) once ``limit_s`` (from ``areal.watchdog_s``) passed with neither.
    """

    def __init__(
        self,
        limit_s: float,
        report: Callable[[float], str],
        stop: Callable[[str], None] | None = None,
        interval_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
        probe: Callable[[], str | None] = lambda: None,
        progress: Callable[[], Any] = lambda: None,
    ) -> None:
        self.limit_s = limit_s
        self.report = report
        self.probe = probe
        self.progress = progress
        self.stop = stop or _stop_the_process
        self.interval_s = interval_s
        self.clock = clock
        self.fired: str | None = None
        #: What the trainer is doing now (``old log-probs``, ``update``, ``weight sync``), for the report.
        self.phase = "setup"
        self._last_beat = clock()
        self.marker: Any = None  # the last progress read
        self._progress_error = ""
        self._paused = False
        self._done = threading.Event()

    def beat(self, phase: str | None = None) -> None:
        """The trainer moved (its wait, or a phase finished); ``phase``: what it does from now on."""
        self._last_beat = self.clock()
        if phase is not None:
            self.phase = phase

    def idle_s(self) -> float:
        """Seconds since the last beat or change of progress."""
        return self.clock() - self._last_beat

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Not judged inside (validation: as long as the validation set takes to generate)."""
        self._paused = True
        try:
            yield
        finally:
            self._paused = False
            self._last_beat = self.clock()

    def _read_progress(self) -> None:
        try:
            marker = self.progress()
        except Exception as error:  # evidence unavailable: judged by the beats alone until it answers again
            if repr(error) != self._progress_error:
                self._progress_error = repr(error)
                logger.warning("areal: the stall guard cannot read the run's progress (%r)", error)
            return
        if marker != self.marker:
            self.marker = marker
            self._last_beat = self.clock()

    def look(self) -> bool:
        """One look; True once it has stopped the run."""
        if self.fired is not None:
            return True
        self._read_progress()  # on every look, so the marker a change is judged against is at most one look old
        idle = self.clock() - self._last_beat
        # A dead actor the trainer is blocked on: no need to wait for the limit. While the trainer is in its
        # wait (beating every second) its own check raises in its thread, the cleaner stop: not looked here.
        found = self.probe() if idle > self.interval_s else None
        if found is not None or (not self._paused and idle > self.limit_s):
            self.fired = found if found is not None else self.report(idle)
            logger.error(self.fired)
            announce_stop(self.fired)
            self.stop(self.fired)
        return self.fired is not None

    def start(self) -> None:
        threading.Thread(target=self._run, name="areal-stall-guard", daemon=True).start()

    def close(self) -> None:
        self._done.set()

    def _run(self) -> None:
        while not self._done.wait(self.interval_s):
            if self.look():
                return


def announce_stop(reason: str) -> None:
    """Write ``reason`` as the last line of a traceback would read, so the CLI reports it as the run's cause.

    ``areal-plugins train`` names the last error line of ours it saw in verl's output; the errors Ray prints
    while the stop tears the job down (``TaskCancelledError``) would otherwise be the last word.
    """
    import sys

    sys.stderr.write(f"{TrainerStalledError.__module__}.{TrainerStalledError.__name__}: {reason}\n")
    sys.stderr.flush()


#: Seconds a stop may take after the guard's limit: one look interval, the grace before the process
#: ends and the CLI's teardown (with 15 s here a hung trainer was stopped 118 s after its last
#: progress and the CLI returned at 124 s of a 120 s watchdog).
STOP_MARGIN_S = 30.0


def stall_limit(watchdog_s: float) -> float:
    """The guard's limit, so that a hung trainer is stopped within ``watchdog_s`` of its last progress."""
    return max(watchdog_s - STOP_MARGIN_S, watchdog_s / 2)


#: Seconds the trainer's thread gets to end after the stall guard's interrupt before the process exits (the interrupt
#: lands only once the thread is back in Python; a thread blocked in a native call never gets there).
INTERRUPT_GRACE_S = 10.0


def _stop_the_process(reason: str, grace_s: float = INTERRUPT_GRACE_S) -> None:
    import _thread
    import os

    _thread.interrupt_main()  # raises KeyboardInterrupt in the trainer's thread if it returns to Python
    time.sleep(grace_s)
    logger.error("areal: the trainer did not stop within %.0f s of %r; exiting the process", grace_s, reason)
    announce_stop(reason)  # the last line before the exit: what Ray printed meanwhile is not the cause
    os._exit(1)
