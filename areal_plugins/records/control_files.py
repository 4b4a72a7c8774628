"""The files in a run directory through which the CLI and verl's driver talk: the stop request the CLI writes on
Ctrl-C (the trainer reads it at each phase boundary), and the phase times the trainer measures (the CLI's wait).

Both sides import this module; neither imports the other (the CLI is :mod:`areal_plugins.cli.control`, the trainer
:mod:`areal_plugins.driver.async_trainer`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class RunStoppedOnRequestError(RuntimeError):
    """Ctrl-C or SIGTERM to ``areal-plugins train`` asked the trainer to stop between two steps (it did)."""


#: The file in the run directory that asks the trainer to stop between two steps (with a checkpoint).
STOP_REQUEST_FILE = "areal_stop_requested"
#: What the trainer measured of its phases, for the CLI's wait: one JSON line each time a longest time grows.
PHASE_TIMES_FILE = "areal_phase_times.jsonl"
#: Of the Ctrl-C's wait beyond the measured phase and checkpoint: the trainer's look at the stop request and
#: its stop, as a share of what was measured (a phase is timed once per step; the next may run a bit longer).
STOP_WAIT_SLACK = 0.25
#: Seconds verl gets to stop after the CLI's SIGTERM before its process group is killed: its own teardown (Ray's
#: shutdown, the engines' servers) once nothing is left to save; a checkpointed stop is waited for before SIGTERM.
SIGTERM_GRACE_S = 20.0
#: How long the cleanup tasks on a cluster's nodes get to answer after a run, all together: a task starts a Ray worker
#: on its node (seconds) and scans that node's processes.
CLUSTER_CLEANUP_S = 60.0
#: How long every node of a cluster gets, all together, to read back the checkpoint folder's marker before a run that
#: restarts itself (cli/shared_folders.py): a task starts a Ray worker on its node and reads one small file.
SHARED_FOLDER_PROBE_S = 30.0


class PhaseTimes:
    """The longest phase (old log-probs, update, weight sync, validation) and checkpoint a run measured.

    The trainer reads a stop request at each phase boundary, so a stop takes at most one phase and then a
    checkpoint. Unmeasured, each counts as ``areal.watchdog_s``: the longest the stall guard lets a phase go
    without progress would be a hang, and a phase that moves may be longer, which the next record says.
    """

    def __init__(self, watchdog_s: float) -> None:
        self.watchdog_s = watchdog_s
        self.longest: dict[str, float] = {}

    def measured(self, phase: str, seconds: float) -> bool:
        """Record one phase's time; True when it is the longest of its kind so far (worth a new record)."""
        if seconds <= self.longest.get(phase, 0.0):
            return False
        self.longest[phase] = seconds
        return True

    def record(self) -> dict[str, Any]:
        phases = {k: v for k, v in self.longest.items() if k != "checkpoint"}
        return {
            "watchdog_s": self.watchdog_s,
            "longest_phase": max(phases, key=phases.__getitem__) if phases else None,
            "longest_phase_s": max(phases.values()) if phases else None,
            "checkpoint_s": self.longest.get("checkpoint"),
            "phases_s": dict(self.longest),
        }


def stop_wait_s(run_dir: Path | None) -> float | None:
    """How long a checkpointed stop may take: the measured longest phase plus the measured checkpoint, plus
    :data:`STOP_WAIT_SLACK`; ``areal.watchdog_s`` for each not measured yet. None: the run published nothing."""
    if run_dir is None or not (run_dir / PHASE_TIMES_FILE).exists():
        return None
    lines = [line for line in (run_dir / PHASE_TIMES_FILE).read_text().splitlines() if line.strip()]
    if not lines:
        return None
    try:
        last = json.loads(lines[-1])
    except json.JSONDecodeError:  # a line being written: the one before is whole
        if len(lines) < 2:
            return None
        last = json.loads(lines[-2])
    fallback = float(last["watchdog_s"])
    phase = last.get("longest_phase_s") or fallback
    checkpoint = last.get("checkpoint_s") or fallback
    return (float(phase) + float(checkpoint)) * (1.0 + STOP_WAIT_SLACK)
