"""The CLI's run control against real child processes: first signal stops, second kills, leftovers found by env."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from areal_plugins.run.control import RunStopper, kill_run_leftovers, new_group_dying_with_parent

#: A child that ignores SIGTERM (as a busy verl driver may for a while) and would sleep for a minute.
STUBBORN = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)"


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


def test_a_child_that_ignores_sigterm_is_killed_after_the_grace_or_by_a_second_signal():
    child = start(STUBBORN)
    time.sleep(0.5)  # let it install its handler
    RunStopper(child, grace_s=0.5)._on_signal(signal.SIGTERM, None)
    assert child.wait(timeout=10) == -signal.SIGKILL  # the grace timer
    child = start(STUBBORN)
    time.sleep(0.5)
    stopper = RunStopper(child, grace_s=30)
    stopper._on_signal(signal.SIGINT, None)
    stopper._on_signal(signal.SIGINT, None)  # Ctrl-C again
    assert child.wait(timeout=10) == -signal.SIGKILL


def test_leftovers_are_the_processes_carrying_the_run_directory(tmp_path):
    ours = start("import time; time.sleep(60)", AREAL_RUN_DIR=str(tmp_path))
    other = start("import time; time.sleep(60)", AREAL_RUN_DIR=str(tmp_path / "another_run"))
    try:
        time.sleep(0.5)
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
