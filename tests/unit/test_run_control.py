"""The CLI's run control against real child processes: first signal stops, second kills, leftovers found by env."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from areal_plugins.cli.control import RunStopper, kill_run_leftovers, new_group_dying_with_parent
from tests.unit.conftest import wait_until

#: A child that ignores SIGTERM (as a busy verl driver may for a while) and would sleep for a minute; it
#: creates the file ``{ready}`` once its handler is installed.
STUBBORN = (
    "import pathlib, signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    "pathlib.Path({ready!r}).touch(); time.sleep(60)"
)


def start_stubborn(ready) -> subprocess.Popen:
    child = start(STUBBORN.format(ready=str(ready)))
    wait_until(ready.exists, what="the child's SIGTERM handler")
    return child


def start(code: str, **env: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", code], env={**os.environ, **env}, preexec_fn=new_group_dying_with_parent
    )


def test_first_signal_terminates_the_group():
    child = start("import time; time.sleep(60)")
    stopper = RunStopper(child, grace_s=30)
    stopper._on_signal(signal.SIGINT, None)
    assert child.wait(timeout=10) == -signal.SIGTERM
    assert stopper.signal_received == signal.SIGINT


def test_a_child_that_ignores_sigterm_is_killed_after_the_grace_or_by_a_second_signal(tmp_path):
    child = start_stubborn(tmp_path / "first")
    RunStopper(child, grace_s=0.5)._on_signal(signal.SIGTERM, None)
    assert child.wait(timeout=10) == -signal.SIGKILL  # the grace timer
    child = start_stubborn(tmp_path / "second")
    stopper = RunStopper(child, grace_s=30)
    stopper._on_signal(signal.SIGINT, None)
    stopper._on_signal(signal.SIGINT, None)  # Ctrl-C again
    assert child.wait(timeout=10) == -signal.SIGKILL


def test_leftovers_are_the_processes_carrying_the_run_directory(tmp_path):
    ours = start("import time; time.sleep(60)", AREAL_RUN_DIR=str(tmp_path))
    other = start("import time; time.sleep(60)", AREAL_RUN_DIR=str(tmp_path / "another_run"))
    try:
        for child in (ours, other):  # its environment is readable once it runs python
            wait_until(lambda c=child: "AREAL_RUN_DIR" in psutil.Process(c.pid).environ(), what="the child's start")
        assert kill_run_leftovers(tmp_path) == 1
        assert ours.wait(timeout=10) == -signal.SIGKILL
        assert other.poll() is None  # another run's process is left alone
    finally:
        other.kill()
        other.wait()


def test_with_checkpoints_the_first_signal_asks_for_a_stop_between_steps(tmp_path):
    # A child that stops by itself once the request file appears (as the trainer does at its next wait).
    request = tmp_path / "areal_stop_requested"
    polite = f"import os, time\nwhile not os.path.exists({str(request)!r}): time.sleep(0.05)\nraise SystemExit(3)"
    child = start(polite)
    RunStopper(child, grace_s=30, stop_request=request, stop_wait_s=30)._on_signal(signal.SIGINT, None)
    assert child.wait(timeout=10) == 3  # it stopped itself: no SIGTERM was sent
    assert request.read_text() == "SIGINT\n"
    # One that does not react is terminated once the wait is over.
    child = start("import time; time.sleep(60)")
    RunStopper(child, grace_s=30, stop_request=tmp_path / "again", stop_wait_s=0.5)._on_signal(signal.SIGTERM, None)
    started = time.monotonic()
    assert child.wait(timeout=10) == -signal.SIGTERM
    assert time.monotonic() - started >= 0.4


def write_phase_times(run_dir, watchdog_s, phases):
    from areal_plugins.records.control_files import PHASE_TIMES_FILE, PhaseTimes

    times = PhaseTimes(watchdog_s)
    lines = [json.dumps(times.record())]
    for phase, seconds in phases:
        if times.measured(phase, seconds):
            lines.append(json.dumps(times.record()))
    (run_dir / PHASE_TIMES_FILE).write_text("\n".join(lines) + "\n")


def test_the_stop_waits_for_the_runs_measured_longest_phase_and_checkpoint(tmp_path):
    """A 7B step: old log-probs 15 min, update 40 min, checkpoint 6 min (then a shorter update, 30 min). The
    wait before SIGTERM covers one whole phase and a checkpoint: (2400 + 360) x 1.25 = 3450 s, past 40 min."""
    from areal_plugins.records.control_files import stop_wait_s

    write_phase_times(
        tmp_path, 3600.0, [("old log-probs", 900.0), ("update", 2400.0), ("checkpoint", 360.0), ("update", 1800.0)]
    )
    wait = stop_wait_s(tmp_path)
    assert wait == pytest.approx(3450.0)
    assert wait > 40 * 60
    stopper = RunStopper(start("import time; time.sleep(60)"), stop_request=tmp_path / "areal_stop_requested")
    try:
        assert stopper.stop_wait_s() == pytest.approx(3450.0)
    finally:
        stopper.process.kill()


def test_what_is_not_measured_yet_counts_as_the_watchdog(tmp_path):
    """Step 1 has not ended its first phase: each term is areal.watchdog_s (3600 s in recipes/gpu/):
    (3600 + 3600) x 1.25 = 9000 s; with the phase measured (2400 s) and no checkpoint yet: 7500 s."""
    from areal_plugins.records.control_files import stop_wait_s

    write_phase_times(tmp_path, 3600.0, [])
    assert stop_wait_s(tmp_path) == pytest.approx(9000.0)
    write_phase_times(tmp_path, 3600.0, [("update", 2400.0)])
    assert stop_wait_s(tmp_path) == pytest.approx(7500.0)
    assert stop_wait_s(tmp_path / "nothing") is None


def test_a_longer_phase_measured_during_the_wait_extends_it(tmp_path):
    request = tmp_path / "areal_stop_requested"
    write_phase_times(tmp_path, 0.4, [("update", 0.4), ("checkpoint", 0.4)])  # (0.4 + 0.4) x 1.25 = 1 s
    child = start("import time; time.sleep(60)")
    stopper = RunStopper(child, grace_s=30, stop_request=request)
    started = time.monotonic()
    stopper._on_signal(signal.SIGINT, None)
    write_phase_times(tmp_path, 0.4, [("update", 2.0), ("checkpoint", 0.4)])  # now (2.0 + 0.4) x 1.25 = 3 s
    assert child.wait(timeout=20) == -signal.SIGTERM
    assert time.monotonic() - started >= 2.9
