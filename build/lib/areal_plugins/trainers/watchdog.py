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
        self._marker: Any = None
        self._since = time.monotonic()
        self._started = self._since

    def check(self, marker: Callable[[], Any], report: Callable[[float], str]) -> None:
        now = time.monotonic()
        if now - self._started < CHECK_INTERVAL_S:  # no statistics calls on every fast wait
            return
        current = marker()
        if current != self._marker:
            self._marker, self._since = current, now
        elif now - self._since > self.limit_s:
            raise TimeoutError(report(now - self._since))


#: A compute span may take this many times the longest one the run has measured before the guard calls the
#: trainer hung: a step's compute grows with response lengths over a run; a hang does not end at all.
SPAN_FACTOR = 3.0


class StallGuard:
    """Stops the run when the trainer stays away from its batch wait too long (a hung trainer worker).

    The wait beats it on every look; between two waits the trainer computes (old log-probs, update, weight
    sync). A worker that hangs there never returns, so nothing in the trainer's own thread can notice:
    this thread logs the report and stops the run through ``stop`` (by default: KeyboardInterrupt in the
    trainer's thread, then, if that does not end it within ``grace_s``, the process).

    The limit is the run's own: ``limit_s`` (from ``areal.watchdog_s``) until a span is measured, then
    :data:`SPAN_FACTOR` x the longest compute span measured so far, if that is longer. The span before the
    first beat (the trainer's setup) is not a step and is not measured.
    """

    def __init__(
        self,
        limit_s: float,
        report: Callable[[float], str],
        stop: Callable[[str], None] | None = None,
        interval_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
        probe: Callable[[], str | None] = lambda: None,
    ) -> None:
        self.limit_s = limit_s
        self.report = report
        self.probe = probe
        self.stop = stop or _stop_the_process
        self.interval_s = interval_s
        self.clock = clock
        self.fired: str | None = None
        self.longest_span_s = 0.0
        self._last_beat = clock()
        self._beaten = False
        self._paused = False
        self._done = threading.Event()

    @property
    def current_limit_s(self) -> float:
        return max(self.limit_s, SPAN_FACTOR * self.longest_span_s)

    def beat(self) -> None:
        now = self.clock()
        if self._beaten and not self._paused:
            self.longest_span_s = max(self.longest_span_s, now - self._last_beat)
        self._last_beat, self._beaten = now, True

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Not judged inside (validation: as long as the validation set takes to generate), nor measured."""
        self._paused = True
        try:
            yield
        finally:
            self._paused = False
            self._last_beat = self.clock()

    def look(self) -> bool:
        """One look; True once it has stopped the run."""
        if self.fired is not None:
            return True
        idle = self.clock() - self._last_beat
        # A dead actor the trainer is blocked on: no need to wait for the limit. While the trainer is in its
        # wait (beating every second) its own check raises in its thread, the cleaner stop: not looked here.
        found = self.probe() if idle > self.interval_s else None
        if found is not None or (not self._paused and idle > self.current_limit_s):
            self.fired = found if found is not None else self.report(idle)
            logger.error(self.fired)
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


#: Seconds a stop may take after the guard's limit: one look interval, the grace before the process
#: ends and the CLI's teardown (with 15 s here a hung trainer was stopped 118 s after its last
#: progress and the CLI returned at 124 s of a 120 s watchdog).
STOP_MARGIN_S = 30.0


def stall_limit(watchdog_s: float) -> float:
    """The guard's limit, so that a hung trainer is stopped within ``watchdog_s`` of its last progress."""
    return max(watchdog_s - STOP_MARGIN_S, watchdog_s / 2)


def _stop_the_process(reason: str, grace_s: float = 10.0) -> None:
    import _thread
    import os

    _thread.interrupt_main()  # raises KeyboardInterrupt in the trainer's thread if it returns to Python
    time.sleep(grace_s)
    logger.error("areal: the trainer did not stop within %.0f s of %r; exiting the process", grace_s, reason)
    os._exit(1)
