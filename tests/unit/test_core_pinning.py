"""The bench's ``--trainer-cores``: a run's trainer workers on cores of their own, every other process on the rest."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import psutil
import pytest
from areal_bench.core_pinning import CorePinner, affinity_of, split_cores

#: A process with a second thread started before any pinning, titled as Ray titles a worker (``exec -a``).
THREADED = (
    "import threading, time; threading.Thread(target=time.sleep, args=(60,), daemon=True).start(); time.sleep(60)"
)


def role_of(cmdline: list[str]) -> str:
    return cmdline[0].removeprefix("ray::") if cmdline else "other"


def test_the_trainer_takes_the_first_cores_and_the_run_the_rest():
    assert split_cores(1, [0, 1]) == ({0}, {1})
    assert split_cores(2, [4, 5, 6, 7]) == ({4, 5}, {6, 7})
    for bad in (0, 2):  # none for the trainer, or none left for the rest of the run
        with pytest.raises(ValueError, match=r"pick 1\.\.1"):
            split_cores(bad, [0, 1])


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="pinning needs two cores")
def test_every_thread_of_a_trainer_worker_moves_and_nothing_else_does():
    trainer, rest = split_cores(1)
    script = (
        f"exec -a ray::WorkerDict {sys.executable} -c '{THREADED}' & "
        f"exec -a ray::AgentLoopWorker {sys.executable} -c '{THREADED}' & wait"
    )
    with CorePinner(trainer, rest, role_of, every_s=0.1) as pinner:
        root = subprocess.Popen(["bash", "-c", script])
        children: list[psutil.Process] = []
        try:
            deadline = time.monotonic() + 30
            # Both processes running with both threads before the pinner looks: the second thread did not inherit.
            while len(children) < 2 or any(len(affinity_of(c.pid)) < 2 for c in children):
                assert time.monotonic() < deadline, children
                time.sleep(0.1)
                children = psutil.Process(root.pid).children()
            pinner.root_pid = root.pid
            while not pinner.pinned:
                assert time.monotonic() < deadline
                time.sleep(0.1)
            by_role = {role_of(p.cmdline()): p.pid for p in children}
            worker, other = affinity_of(by_role["WorkerDict"]), affinity_of(by_role["AgentLoopWorker"])
            assert len(worker) == 2 and all(cores == trainer for cores in worker.values()), worker
            # Everything else keeps what it inherited from the bench: the other cores.
            assert len(other) == 2 and all(cores == rest for cores in other.values()), other
            assert set(pinner.pinned.values()) == {"WorkerDict"}
        finally:
            for process in [*children, root]:
                process.kill()
    assert os.sched_getaffinity(0) == trainer | rest  # the bench itself gets its cores back
