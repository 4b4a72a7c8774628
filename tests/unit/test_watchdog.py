"""The async trainer's watchdog: it fires only when nothing moves for the configured time."""

from __future__ import annotations

import time

import pytest

from areal_plugins.trainers import watchdog as trainer
from areal_plugins.trainers.watchdog import Watchdog


def test_fires_with_the_report_when_nothing_moves(monkeypatch):
    monkeypatch.setattr(trainer, "CHECK_INTERVAL_S", 0.0)
    watchdog = Watchdog(limit_s=0.05)
    watchdog.check(lambda: (1, 10), lambda waited: "stuck")
    time.sleep(0.1)
    with pytest.raises(TimeoutError, match="stuck"):
        watchdog.check(lambda: (1, 10), lambda waited: "stuck")


def test_progress_resets_the_clock(monkeypatch):
    monkeypatch.setattr(trainer, "CHECK_INTERVAL_S", 0.0)
    watchdog = Watchdog(limit_s=0.05)
    for tokens in range(5):
        time.sleep(0.03)
        watchdog.check(lambda tokens=tokens: (1, tokens), lambda waited: "stuck")  # tokens keep coming
