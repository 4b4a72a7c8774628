"""The trainer on cores of its own, for the bench (``tools/bench.py --trainer-cores K``).

On the 2-core box the rollout side's Python (agent loops, reward, TransferQueue, admission, the checkpoint engine)
runs on the trainer's cores, so a row measures the box's contention as much as the design. A GPU cluster gives the
trainer its GPUs: here the run's trainer workers (Ray titles them ``ray::WorkerDict``) get the first K cores and
every other process of the run the rest, so the limit the bench computes from a synchronous step measured the same
way is one an asynchronous row can reach.

How: the bench's own process moves to the other cores before it starts the run, so every process the run starts
inherits them; a thread then moves each trainer worker, every one of its threads, to the trainer's cores as soon as
it appears (a Ray worker becomes ``WorkerDict`` after it started), and keeps looking, for threads started later
under another affinity. Linux only (``os.sched_setaffinity`` per thread id).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable

#: Ray's process titles of the trainer's workers (verl's fused actor/rollout/ref worker class).
TRAINER_ROLES = frozenset({"WorkerDict"})


def split_cores(trainer_cores: int, cores: list[int] | None = None) -> tuple[set[int], set[int]]:
    """``(the trainer's cores, everyone else's)``: the first ``trainer_cores`` of the cores this process may run on,
    and the rest (at least one each)."""
    usable = sorted(cores if cores is not None else os.sched_getaffinity(0))
    if not 1 <= trainer_cores < len(usable):
        raise ValueError(
            f"--trainer-cores {trainer_cores}: this machine gives the bench {len(usable)} cores; the trainer needs at "
            f"least 1 and the rest of the run at least 1, so pick 1..{len(usable) - 1}"
        )
    return set(usable[:trainer_cores]), set(usable[trainer_cores:])


def thread_ids(pid: int) -> list[int]:
    """The thread ids of process ``pid`` (empty once it is gone)."""
    try:
        return [int(tid) for tid in os.listdir(f"/proc/{pid}/task")]
    except FileNotFoundError:
        return []


class CorePinner:
    """Pins a run's trainer workers to ``trainer`` cores, every ``every_s``, once :attr:`root_pid` is set.

    ``role_of`` names a process from its command line (the bench's ``process_role``). :attr:`pinned` records each
    trainer worker moved (pid -> role), so the bench can refuse a row in which none was: a run whose trainer kept the
    shared cores would be reported as pinned when it was not.
    """

    def __init__(
        self, trainer: set[int], rest: set[int], role_of: Callable[[list[str]], str], every_s: float = 0.5
    ) -> None:
        self.trainer, self.rest, self.role_of, self.every_s = trainer, rest, role_of, every_s
        self.root_pid: int | None = None
        self.pinned: dict[int, str] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._before: set[int] | None = None

    def __enter__(self) -> CorePinner:
        self._before = os.sched_getaffinity(0)
        os.sched_setaffinity(0, self.rest)  # what the run's processes inherit
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        if self._before is not None:
            os.sched_setaffinity(0, self._before)

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            if self.root_pid is not None:
                self.pin_once(self.root_pid)

    def pin_once(self, root_pid: int) -> None:
        """Move every thread of each trainer worker under ``root_pid`` to the trainer's cores."""
        import psutil

        try:
            processes = psutil.Process(root_pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return
        for process in processes:
            try:
                role = self.role_of(process.cmdline())
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
            if role not in TRAINER_ROLES:
                continue
            for tid in thread_ids(process.pid):
                try:
                    if os.sched_getaffinity(tid) != self.trainer:
                        os.sched_setaffinity(tid, self.trainer)
                except (ProcessLookupError, PermissionError):
                    continue  # the thread ended between the listing and the call
            self.pinned[process.pid] = role


def affinity_of(pid: int) -> dict[int, set[int]]:
    """Thread id -> the cores it may run on, for every thread of ``pid`` (what the tests and the bench check)."""
    out: dict[int, set[int]] = {}
    for tid in thread_ids(pid):
        try:
            out[tid] = os.sched_getaffinity(tid)
        except ProcessLookupError:
            continue
    return out
