"""The CLI's run control against real child processes: first signal stops, second kills, leftovers found by env."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil

from areal_plugins.run.control import RunStopper, kill_run_leftovers, new_group_dying_with_parent
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
