"""The CLI's run control against real child processes: first signal stops, second kills, leftovers found by env."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from areal_plugins.cli import control
from areal_plugins.cli.control import (
    RunStopper,
    end_run_leftovers,
    kill_run_leftovers,
    leftover_pids,
    new_group_dying_with_parent,
)
from areal_plugins.cli.every_node import alive_nodes
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


def test_a_nodes_leftovers_are_its_processes_naming_the_run_but_the_one_looking_and_those_above_it():
    run = "/runs/a"
    processes = [
        (10, {"AREAL_RUN_DIR": run}),  # a vLLM engine core left by a killed server actor
        (11, {"AREAL_RUN_DIR": "/runs/b"}),  # another run's
        (12, {"PATH": "/bin"}),  # the cluster's own raylet, started by `ray start`
        (13, None),  # another user's: its environment cannot be read
        (14, {"AREAL_RUN_DIR": run}),  # the cleanup task itself (a worker of the CLI's job)...
        (15, {"AREAL_RUN_DIR": run}),  # ...and the raylet above it, were it started with the run's environment
    ]
    assert leftover_pids(processes, run, spared={14, 15}) == [10]


def test_a_clusters_cleanup_runs_on_every_alive_node_the_head_and_cpu_only_nodes_included():
    nodes = [  # as ray.nodes() lists them
        {"NodeID": "head", "Alive": True, "Resources": {"CPU": 4.0}},
        {"NodeID": "gpu-a", "Alive": True, "Resources": {"CPU": 16.0, "GPU": 8.0}},
        {"NodeID": "gpu-b", "Alive": False, "Resources": {}},  # lost: its processes went with it
        {"NodeID": "gpu-c", "Alive": True, "Resources": {"CPU": 16.0, "GPU": 8.0}},
    ]
    assert [node for node, _ in alive_nodes(nodes)] == ["head", "gpu-a", "gpu-c"]


def test_the_cli_ends_leftovers_on_the_cluster_it_joined_and_only_then(monkeypatch, tmp_path, caplog):
    asked: list[tuple] = []
    monkeypatch.setattr(control, "kill_run_leftovers", lambda run_dir: 1)  # this machine's

    def on_cluster(address, run_dir):
        asked.append((address, run_dir))
        return {"a": 2, "b": 0}  # node -> processes ended there

    monkeypatch.setattr(control, "kill_run_leftovers_on_cluster", on_cluster)
    assert end_run_leftovers(tmp_path, None) == 1 and asked == []  # a local Ray: it died with the driver
    assert end_run_leftovers(tmp_path, "10.0.0.1:6379") == 3 and asked == [("10.0.0.1:6379", tmp_path)]

    def unreachable(address, run_dir):
        raise ConnectionError("no GCS at 10.0.0.1:6379")

    monkeypatch.setattr(control, "kill_run_leftovers_on_cluster", unreachable)
    with caplog.at_level(logging.WARNING):
        assert end_run_leftovers(tmp_path, "10.0.0.1:6379") == 1  # the run has ended: said, not raised
    assert "could not reach the Ray cluster at 10.0.0.1:6379" in caplog.text


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


def test_a_node_that_reads_no_marker_another_or_none_in_time_does_not_share_the_folder():
    from areal_plugins.cli.every_node import NodeAnswer
    from areal_plugins.cli.shared_folders import nodes_without

    answers = [
        NodeAnswer("aaaaaaaa11", "10.0.0.1", result="token"),
        NodeAnswer("bbbbbbbb22", "10.0.0.2", result=None),
        NodeAnswer("cccccccc33", "10.0.0.3", result="other"),
        NodeAnswer("dddddddd44", "10.0.0.4", error="GetTimeoutError: too slow"),
    ]
    assert nodes_without(answers, "token") == [
        "10.0.0.2 (bbbbbbbb): no such file",
        "10.0.0.3 (cccccccc): another file",
        "10.0.0.4 (dddddddd): did not answer (GetTimeoutError: too slow)",
    ]
    assert nodes_without(answers[:1], "token") == []
