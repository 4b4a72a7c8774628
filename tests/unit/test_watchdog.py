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


def test_stall_guard_stops_a_trainer_that_never_comes_back_to_its_wait():
    from areal_plugins.trainers.watchdog import StallGuard

    now = [0.0]
    stopped: list[str] = []
    guard = StallGuard(100.0, lambda idle: f"stuck for {idle:.0f} s", stop=stopped.append, clock=lambda: now[0])
    now[0] = 90.0
    assert not guard.look()
    guard.beat()  # the trainer came back to its wait at 90 s
    now[0] = 180.0
    assert not guard.look() and not stopped
    now[0] = 191.0
    assert guard.look() and stopped == ["stuck for 101 s"]
    now[0] = 500.0
    guard.look()
    assert stopped == ["stuck for 101 s"]  # once


def test_stall_guard_limit_grows_with_the_runs_own_measured_steps():
    """A 7B step can outlast a limit set for the tiny model: once the run has measured a step of 60 s, a step
    may take 3 x 60 = 180 s before it is called hung (the base limit, 100 s, holds until then)."""
    from areal_plugins.trainers.watchdog import StallGuard

    now = [0.0]
    stopped: list[str] = []
    guard = StallGuard(100.0, lambda idle: f"stuck for {idle:.0f} s", stop=stopped.append, clock=lambda: now[0])
    now[0] = 500.0
    guard.beat()  # first beat: the setup before it is not a step (the limit stays 100 s)
    assert guard.current_limit_s == 100.0
    now[0] = 560.0
    guard.beat()  # back in the wait after 60 s of compute
    now[0] = 561.0
    guard.beat()  # one second of waiting: a span of 1 s changes nothing
    assert guard.current_limit_s == 180.0
    now[0] = 561.0 + 179.0
    assert not guard.look() and not stopped  # 179 s: longer than 100 s, within 3 x 60 s
    now[0] = 561.0 + 181.0
    assert guard.look() and stopped == ["stuck for 181 s"]


def test_stall_guard_does_not_judge_validation():
    from areal_plugins.trainers.watchdog import StallGuard

    now = [0.0]
    stopped: list[str] = []
    guard = StallGuard(100.0, str, stop=stopped.append, clock=lambda: now[0])
    with guard.paused():
        now[0] = 1000.0
        assert not guard.look()
    now[0] = 1050.0
    assert not guard.look() and not stopped  # leaving validation counts as a beat
    assert guard.longest_span_s == 0.0  # and validation is not a step: the limit does not grow from it


def test_stall_guard_stops_at_once_when_its_probe_finds_a_dead_actor():
    from areal_plugins.trainers.watchdog import StallGuard

    now = [0.0]
    stopped: list[str] = []
    dead: list[str | None] = ["SimpleStorageUnit (pid 7) died"]
    guard = StallGuard(900.0, str, stop=stopped.append, clock=lambda: now[0], probe=lambda: dead[0])
    now[0] = 3.0
    assert not guard.look()  # the trainer beat 3 s ago: it is in its wait, whose own check raises
    now[0] = 10.0
    assert guard.look() and stopped == ["SimpleStorageUnit (pid 7) died"]  # long before the 900 s limit


def test_the_stall_limit_leaves_room_to_stop_within_the_watchdog():
    from areal_plugins.trainers.watchdog import stall_limit

    # 5 s between looks + 10 s for the trainer to stop + the CLI's teardown, with slack: done by 900 s
    assert stall_limit(900.0) == 870.0
    assert stall_limit(20.0) == 10.0  # never below half the limit
