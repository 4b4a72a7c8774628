"""Stopping a run the CLI started: Ctrl-C and SIGTERM stop it within seconds and leave no process behind.

verl's ``main_ppo`` runs in a process group of its own. On the first SIGINT or SIGTERM the CLI receives:
when the run is ``areal_async`` with checkpoints on (``trainer.save_freq > 0``), it writes
:data:`STOP_REQUEST_FILE` into the run directory, which the trainer reads between two steps (it
checkpoints the last finished step and stops), and sends SIGTERM only if verl is still running after
:func:`stop_wait_s`, the run's own longest phase plus its longest checkpoint as the trainer measured them
(:data:`PHASE_TIMES_FILE`); otherwise (verl's own trainers, ``areal.mode: sync``, no checkpoints) it sends
SIGTERM at once. SIGKILL follows SIGTERM after :data:`GRACE_S`; a second signal sends SIGKILL at once.
Whatever the run started and left behind (Ray's daemons and workers, engine servers) carries the run
directory in its environment (``AREAL_RUN_DIR``, inherited from verl's driver) and is killed after the
driver is gone.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

from areal_plugins.records.control_files import stop_wait_s

logger = logging.getLogger(__name__)


#: Seconds verl gets to stop after SIGTERM before its process group is killed.
GRACE_S = 20.0


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


def kill_run_leftovers(run_dir: Path) -> int:
    """SIGKILL every process (but this one) whose environment names ``run_dir``; how many there were."""
    import psutil

    marker = str(run_dir)
    killed = 0
    for process in psutil.process_iter(["pid"]):
        if process.pid == os.getpid():
            continue
        try:
            if process.environ().get("AREAL_RUN_DIR") == marker:
                process.kill()
                killed += 1
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return killed
