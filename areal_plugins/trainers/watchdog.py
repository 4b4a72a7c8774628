"""The trainer's watchdog: a wait that sees no progress for ``areal.watchdog_s`` stops the run with a report."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

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
