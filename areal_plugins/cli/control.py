"""Stopping a run the CLI started: Ctrl-C and SIGTERM stop it within seconds and leave no process behind.

verl's ``main_ppo`` runs in a process group of its own. On the first SIGINT or SIGTERM the CLI receives:
when the run is ``areal_async`` with checkpoints on (``trainer.save_freq > 0``), it writes
:data:`STOP_REQUEST_FILE` into the run directory, which the trainer reads between two steps (it
checkpoints the last finished step and stops), and sends SIGTERM only if verl is still running after
:func:`stop_wait_s`, the run's own longest phase plus its longest checkpoint as the trainer measured them
(:data:`PHASE_TIMES_FILE`); otherwise (verl's own trainers, ``areal.mode: sync``, no checkpoints) it sends
SIGTERM at once. SIGKILL follows SIGTERM after :data:`GRACE_S`; a second signal sends SIGKILL at once.
Whatever the run started and left behind (Ray's daemons and workers, engine servers) carries the run
directory in its environment (``AREAL_RUN_DIR``, inherited from verl's driver or given by the Ray job) and is
killed after the driver is gone: on this machine, and when the run joined a cluster, on every alive node of it by
one Ray task per node (:func:`end_run_leftovers`).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

from areal_plugins.records.control_files import CLUSTER_CLEANUP_S, stop_wait_s
from areal_plugins.records.control_files import SIGTERM_GRACE_S as GRACE_S  # seconds verl gets after SIGTERM

logger = logging.getLogger(__name__)

#: The environment variable that names the run directory in every process of the run (records/writer.py).
RUN_DIR_ENV = "AREAL_RUN_DIR"


def new_group_dying_with_parent() -> None:
    """``preexec_fn`` of a child the caller owns: a process group of its own, and SIGTERM when the caller dies.

    Runs in the child between fork and exec. The own group lets the caller signal the child and
    everything it starts at once; the parent-death signal stops the child even when the caller is
    SIGKILLed and never gets to stop it.
    """
    import ctypes

    os.setsid()
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class RunStopper:
    """Signal handling of the CLI while ``process`` (verl, group leader of its own group) runs."""

    def __init__(
        self,
        process: subprocess.Popen,
        grace_s: float = GRACE_S,
        stop_request: Path | None = None,
        stop_wait_s: float | None = None,
    ) -> None:
        self.process = process
        self.grace_s = grace_s
        self.stop_request = stop_request
        self._stop_wait_s = stop_wait_s  # None: what the run measured (stop_wait_s), asked at the signal
        self.signal_received: int | None = None
        self._count = 0
        self._signalled_at = 0.0

    def stop_wait_s(self) -> float:
        """How long the first signal waits for the checkpointed stop: given, else what the run measured."""
        if self._stop_wait_s is not None:
            return self._stop_wait_s
        measured = stop_wait_s(self.stop_request.parent if self.stop_request is not None else None)
        if measured is None:  # the trainer has not started (it publishes at once): nothing to checkpoint yet
            return self.grace_s
        return measured

    def install(self) -> None:
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, self._on_signal)

    def _on_signal(self, signum: int, frame: object) -> None:
        self._count += 1
        self.signal_received = self.signal_received or signum
        if self._count == 1 and self.stop_request is not None:
            wait = self.stop_wait_s()
            logger.warning(
                "%s: stopping at the next phase boundary with a checkpoint (SIGTERM to verl in %.0f s, the run's "
                "longest phase plus checkpoint, if it has not stopped; Ctrl-C again to kill at once)",
                signal.Signals(signum).name,
                wait,
            )
            self.stop_request.write_text(f"{signal.Signals(signum).name}\n")
            self._signalled_at = time.monotonic()
            self._later(wait, self._terminate_when_due)
        elif self._count == 1:
            logger.warning(
                "%s: stopping the run (SIGTERM to verl; SIGKILL in %.0f s; Ctrl-C again to kill at once)",
                signal.Signals(signum).name,
                self.grace_s,
            )
            self._terminate()
        else:
            logger.warning("%s again: killing the run now", signal.Signals(signum).name)
            self._kill_group(signal.SIGKILL)

    def _terminate_when_due(self) -> None:
        """SIGTERM, unless the run measured a longer phase or checkpoint meanwhile: then wait for that too."""
        remaining = self._signalled_at + self.stop_wait_s() - time.monotonic()
        if remaining > 1.0 and self.process.poll() is None:
            self._later(remaining, self._terminate_when_due)
            return
        self._terminate()

    def _terminate(self) -> None:
        self._kill_group(signal.SIGTERM)
        self._later(self.grace_s, self._kill_group, signal.SIGKILL)

    @staticmethod
    def _later(delay_s: float, action, *args: object) -> None:  # type: ignore[no-untyped-def]
        timer = threading.Timer(delay_s, action, args=args)
        timer.daemon = True  # never keeps the CLI alive after verl is gone
        timer.start()

    def _kill_group(self, signum: int) -> None:
        if self.process.poll() is None:
            try:
                os.killpg(self.process.pid, signum)
            except ProcessLookupError:
                pass


def leftover_pids(processes: list[tuple[int, dict[str, str] | None]], run_dir: str, spared: set[int]) -> list[int]:
    """Of ``processes`` (pid, environment; None where it cannot be read), the run's: those whose environment names
    ``run_dir`` (``AREAL_RUN_DIR``, which every process of the run inherits or gets from the Ray job), except
    ``spared`` (the process looking, and the processes above it: a cleanup task's raylet)."""
    return [pid for pid, env in processes if pid not in spared and env is not None and env.get(RUN_DIR_ENV) == run_dir]


def kill_run_leftovers(run_dir: Path | str) -> int:
    """SIGKILL every process of this node (but this one and those above it) whose environment names ``run_dir``;
    how many there were."""
    import psutil

    me = psutil.Process()
    spared = {me.pid, *(parent.pid for parent in me.parents())}
    processes: list[tuple[int, dict[str, str] | None]] = []
    handles = {}
    for process in psutil.process_iter(["pid"]):
        try:
            processes.append((process.pid, process.environ()))
            handles[process.pid] = process
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    killed = 0
    for pid in leftover_pids(processes, str(run_dir), spared):
        try:
            handles[pid].kill()
            killed += 1
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return killed


def kill_run_leftovers_on_cluster(address: str, run_dir: Path, timeout_s: float = CLUSTER_CLEANUP_S) -> dict[str, int]:
    """On a cluster the run joined: one task on every alive node (the head and CPU-only nodes included: a run's
    engines, reward workers or agent-loop workers may be on any of them) kills the run's processes left there
    (:func:`kill_run_leftovers`: a process that left its Ray worker's process group outlives the job and holds its
    GPU's memory). Returns node id -> how many; a node whose task did not answer in ``timeout_s`` is left out and
    logged. This process carries no AREAL_RUN_DIR, nor do the workers of its own job."""
    from areal_plugins.cli.every_node import on_every_node

    killed: dict[str, int] = {}
    for answer in on_every_node(address, kill_run_leftovers, str(run_dir), timeout_s=timeout_s):
        if answer.error is None:
            killed[answer.node_id] = int(answer.result)
        else:
            logger.warning("could not look for the run's leftover processes on node %s: %s", answer.name, answer.error)
    return killed


def end_run_leftovers(run_dir: Path, cluster: str | None) -> int:
    """Kill what the run left behind: on this machine, and on a cluster the run joined, on every alive node of it
    (a failure to reach the cluster is logged, not raised: the run has ended). How many processes in all."""
    killed = kill_run_leftovers(run_dir)
    if cluster is None:
        return killed
    try:
        per_node = kill_run_leftovers_on_cluster(cluster, run_dir)
    except Exception as error:
        logger.warning("could not reach the Ray cluster at %s to end the run's processes on its nodes: %s", cluster,
                       error)  # fmt: skip
        return killed
    for node, count in per_node.items():
        if count:
            logger.info("killed %d process(es) the run left on node %s", count, node[:8])
    return killed + sum(per_node.values())
