"""The async trainer's watchdog: it fires only when nothing moves for the configured time."""

from __future__ import annotations

import time

import pytest

from areal_plugins.driver import watchdog as trainer
from areal_plugins.driver.watchdog import Watchdog


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
    from areal_plugins.driver.watchdog import StallGuard

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


def test_a_step_that_progresses_is_never_stopped_however_long():
    """Step 1 of a 7B run on 2 trainer GPUs computes for hours at areal.watchdog_s = 3600 (recipes/gpu/): a
    micro-batch starts every 40 s, so nothing is stuck; the guard lets all 3 hours pass."""
    from areal_plugins.driver.watchdog import StallGuard, stall_limit

    now = [0.0]
    micro_batches = [0]
    stopped: list[str] = []
    guard = StallGuard(
        stall_limit(3600.0), str, stop=stopped.append, clock=lambda: now[0], progress=lambda: micro_batches[0]
    )
    guard.beat("old log-probs")  # the trainer left its wait
    for second in range(5, 3 * 3600, 5):  # the guard's thread looks every 5 s
        now[0] = float(second)
        if second % 40 == 0:
            micro_batches[0] += 1
        assert not guard.look(), f"stopped at {second} s"
    assert not stopped and now[0] > 3 * 3570.0


def test_no_progress_for_the_limit_stops_the_run_counted_from_the_last_progress():
    """Hand count: limit 3570 s (3600 less the 30 s to stop); the last micro-batch started at 1000 s, so the
    look at 4570 s is within the limit (3570 s idle, not past it) and the one at 4575 s stops the run."""
    from areal_plugins.driver.watchdog import StallGuard, stall_limit

    now = [0.0]
    micro_batches = [0]
    stopped: list[str] = []
    guard = StallGuard(
        stall_limit(3600.0),
        lambda idle: f"idle {idle:.0f} s",
        stop=stopped.append,
        clock=lambda: now[0],
        progress=lambda: micro_batches[0],
    )
    guard.look()  # the first reading, at 0 s
    for second in range(5, 1001, 5):
        now[0] = float(second)
        micro_batches[0] += 1
        guard.look()
    now[0] = 4570.0
    assert not guard.look() and not stopped
    now[0] = 4575.0
    assert guard.look() and stopped == ["idle 3575 s"]


def test_an_unreadable_progress_is_no_progress():
    from areal_plugins.driver.watchdog import StallGuard

    now = [0.0]
    stopped: list[str] = []

    def broken():
        raise TimeoutError("the board did not answer")

    guard = StallGuard(100.0, str, stop=stopped.append, clock=lambda: now[0], progress=broken)
    now[0] = 101.0
    assert guard.look() and stopped


def test_a_stop_is_announced_as_our_error_so_the_cli_names_it(capsys):
    """The CLI names the last error line of ours in verl's output (cli/launch.py, follow_output)."""
    from areal_plugins.cli.progress import ERROR_LINE
    from areal_plugins.driver.watchdog import StallGuard

    now = [0.0]
    guard = StallGuard(10.0, lambda idle: "areal watchdog: nothing moved", stop=lambda r: None, clock=lambda: now[0])
    now[0] = 11.0
    assert guard.look()
    line = capsys.readouterr().err.strip().splitlines()[-1]
    match = ERROR_LINE.match(line)
    assert match and match.group(1).startswith("areal_plugins.")
    assert match.group(1).endswith("TrainerStalledError: areal watchdog: nothing moved")


def test_stall_guard_does_not_judge_validation():
    from areal_plugins.driver.watchdog import StallGuard

    now = [0.0]
    stopped: list[str] = []
    guard = StallGuard(100.0, str, stop=stopped.append, clock=lambda: now[0])
    with guard.paused():
        now[0] = 1000.0
        assert not guard.look()
    now[0] = 1050.0
    assert not guard.look() and not stopped  # leaving validation counts as a beat


def test_stall_guard_stops_at_once_when_its_probe_finds_a_dead_actor():
    from areal_plugins.driver.watchdog import StallGuard

    now = [0.0]
    stopped: list[str] = []
    dead: list[str | None] = ["SimpleStorageUnit (pid 7) died"]
    guard = StallGuard(900.0, str, stop=stopped.append, clock=lambda: now[0], probe=lambda: dead[0])
    now[0] = 3.0
    assert not guard.look()  # the trainer beat 3 s ago: it is in its wait, whose own check raises
    now[0] = 10.0
    assert guard.look() and stopped == ["SimpleStorageUnit (pid 7) died"]  # long before the 900 s limit


def test_the_stall_limit_leaves_room_to_stop_within_the_watchdog():
    from areal_plugins.driver.watchdog import stall_limit

    # 5 s between looks + 10 s for the trainer to stop + the CLI's teardown, with slack: done by 900 s
    assert stall_limit(900.0) == 870.0
    assert stall_limit(20.0) == 10.0  # never below half the limit
