"""Requests in flight and the time a rollout server spent with at least one: what ``get_stats`` reports."""

from __future__ import annotations

import time


class RequestActivity:
    """``in_flight`` requests now, and ``busy_seconds()`` with at least one in flight since the start."""

    def __init__(self) -> None:
        self.in_flight = 0
        self._busy_s = 0.0
        self._busy_since: float | None = None

    def enter(self) -> None:
        if self.in_flight == 0:
            self._busy_since = time.monotonic()
        self.in_flight += 1

    def leave(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0 and self._busy_since is not None:
            self._busy_s += time.monotonic() - self._busy_since
            self._busy_since = None

    def busy_seconds(self) -> float:
        """Busy time so far, the current busy stretch included."""
        running = time.monotonic() - self._busy_since if self._busy_since is not None else 0.0
        return self._busy_s + running
