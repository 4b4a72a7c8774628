"""A dead replica's replacement: started in the background, in the weight sync's list before the next sync, in the
load balancer only after it (real Ray actors stand for the servers and verl's load balancer; the integration test
``test_a_dead_replica_of_two_costs_capacity_not_the_run`` runs it through verl)."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import pytest
import ray

from areal_plugins.driver.replica_replacement import ReplicaReplacer
from tests.unit.conftest import replica_lists


class Balancer:
    def __init__(self) -> None:
        self.servers: dict[str, object] = {}

    def add_servers(self, servers: dict) -> None:
        self.servers.update(servers)

    def addresses(self) -> list[str]:
        return sorted(self.servers)


class Server:
    def ping(self) -> str:
        return "pong"


class Recorder:
    def __init__(self) -> None:
        self.lines: list[dict] = []

    def write(self, name: str, line: dict) -> None:
        self.lines.append(line)


@pytest.fixture(scope="module", autouse=True)
def handles_collected_before_ray_shuts_down(local_ray):
    """The module's Ray actor handles are collected while its Ray runs: one collected after the shutdown, during a
    later test file, ended the pytest process (exit code 1, no summary)."""
    yield
    import gc

    gc.collect()


@pytest.fixture(autouse=True)
def start_threads_end_with_their_test():
    """Every replica-start thread a test began ends before the next test (and before this module's Ray shuts down):
    a start left running made a Ray call after the shutdown, which ended the whole pytest process (exit code 1, no
    summary) two test files later."""
    yield
    for thread in threading.enumerate():
        if thread.name.startswith("areal-start-replica-"):
            thread.join(timeout=30)
            assert not thread.is_alive(), f"{thread.name} still running after its test"


def stand_in_manager(started: threading.Event, fails: bool = False, tensor_parallel: int = 1) -> SimpleNamespace:
    class StandInReplica:
        def __init__(self, replica_rank, config, model_config, gpus_per_node) -> None:
            self.replica_rank = replica_rank
            self.resource_pool = None
            self.gpus_per_replica_node, self.nnodes = 0, 1  # this Ray has no GPU: wait_for_devices is tested below

        async def init_standalone(self) -> None:
            started.wait(10)  # Ray places it when it can: the test decides when
            if fails:
                raise RuntimeError("no device left")
            self._server_handle = ray.remote(Server).remote()
            self._server_address = f"server-{self.replica_rank}"

    survivor = SimpleNamespace(replica_rank=0, _server_handle=None, _server_address="server-0")
    manager = SimpleNamespace(
        rollout_replicas=[survivor], server_handles=[None], server_addresses=["server-0"],
        rollout_replica_class=StandInReplica, model_config=None,
        rollout_config=SimpleNamespace(n_gpus_per_node=8, tensor_model_parallel_size=tensor_parallel,
                                       data_parallel_size=1, pipeline_model_parallel_size=1),
        global_load_balancer=ray.remote(Balancer).remote(),
    )  # fmt: skip
    manager.get_replicas = lambda: manager.rollout_replicas
    return manager


def test_a_replacement_joins_the_sync_once_started_and_takes_requests_only_after_it(local_ray):
    placed = threading.Event()
    manager, recorder = stand_in_manager(placed), Recorder()
    lists, checkpoints = replica_lists(manager)
    replacer = ReplicaReplacer(lists, recorder, enabled=True)
    replacer.replace(SimpleNamespace(replica_rank=1, resource_pool=None))  # replica 1 of 0-1 died
    assert replacer.join() == 0 and len(manager.rollout_replicas) == 1  # not placed yet: this sync goes without it
    replacer.serve(version=4)
    assert ray.get(manager.global_load_balancer.addresses.remote()) == []
    placed.set()
    deadline = time.monotonic() + 30
    while replacer._starting and not replacer._starting[0][2].done() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert replacer.join() == 1  # before the next sync: in the list the sync updates, aligned with verl's other two
    assert [r.replica_rank for r in manager.rollout_replicas] == [0, 2]
    assert [r.replica_rank for r in checkpoints.replicas] == [0, 2]  # once, through verl's add_replicas
    assert manager.server_addresses == ["server-0", "server-2"] and len(manager.server_handles) == 2
    assert ray.get(manager.global_load_balancer.addresses.remote()) == []  # no request before the weights
    replacer.serve(version=5)
    assert ray.get(manager.global_load_balancer.addresses.remote()) == ["server-2"]
    assert replacer.replaced == 1 and replacer.pending == 0
    events = [(line["event"], line["replaces"], line["replica"], line.get("version")) for line in recorder.lines]
    assert events == [("replacing", 1, 2, None), ("joined", 1, 2, 5)]


def test_a_replacement_that_cannot_start_is_recorded_and_the_run_goes_on_without_it(local_ray):
    placed = threading.Event()
    placed.set()
    manager, recorder = stand_in_manager(placed, fails=True), Recorder()
    replacer = ReplicaReplacer(replica_lists(manager)[0], recorder, enabled=True)
    replacer.replace(SimpleNamespace(replica_rank=1, resource_pool=None))
    replacer._starting[0][2].exception(timeout=30)
    assert replacer.join() == 0 and len(manager.rollout_replicas) == 1 and replacer.pending == 0
    assert recorder.lines[-1]["event"] == "start_failed" and "no device left" in recorder.lines[-1]["reason"]


def test_with_replacement_off_a_dead_replica_is_only_dropped(local_ray):
    manager, recorder = stand_in_manager(threading.Event()), Recorder()
    replacer = ReplicaReplacer(replica_lists(manager)[0], recorder, enabled=False)
    replacer.replace(SimpleNamespace(replica_rank=1, resource_pool=None))
    assert replacer.pending == 0 and recorder.lines == []


def gpus(*free_per_node: float, cpus: float = 16.0) -> dict:
    """Ray's per-node view of free resources (``available_resources_per_node``) for nodes with these free GPUs."""
    return {f"node{i}{'0' * 8}": {"GPU": n, "CPU": cpus} for i, n in enumerate(free_per_node) if n is not None}


def test_the_replicas_grow_to_their_limit_when_one_node_has_the_devices_for_one_more(local_ray, monkeypatch):
    from areal_plugins.driver import replica_replacement

    free = {"view": gpus(0.0)}
    monkeypatch.setattr(replica_replacement, "free_per_node", lambda: free["view"])
    placed = threading.Event()
    placed.set()
    manager, recorder = stand_in_manager(placed), Recorder()
    replacer = ReplicaReplacer(replica_lists(manager)[0], recorder, enabled=True)
    assert not replacer.grow(None) and not replacer.grow(3)  # no limit set; no free device
    free["view"] = gpus(0.0, 1.0)  # a node with one device joined
    assert replacer.grow(3) and not replacer.grow(3)  # one starts; the next waits until it serves
    replacer._starting[0][2].result(timeout=30)
    assert replacer.join() == 1
    replacer.serve(version=2)
    assert replacer.grown == 1 and replacer.replaced == 0
    assert ray.get(manager.global_load_balancer.addresses.remote()) == ["server-1"]
    assert replacer.grow(3)  # still a free device, 2 of 3 serve
    replacer._starting[0][2].result(timeout=30)
    replacer.join()
    replacer.serve(version=3)
    assert not replacer.grow(3) and len(manager.rollout_replicas) == 3  # at the limit
    events = [line["event"] for line in recorder.lines]
    assert events == ["growth_blocked", "growing", "joined", "growing", "joined"]


def test_two_nodes_with_one_free_gpu_each_start_no_tensor_parallel_2_replica_and_say_why(local_ray, monkeypatch):
    from areal_plugins.driver import replica_replacement

    # Before, the cluster's total (2 free) was enough: the start then waited for a placement Ray never makes.
    monkeypatch.setattr(replica_replacement, "free_per_node", lambda: gpus(1.0, 1.0))
    manager, recorder = stand_in_manager(threading.Event(), tensor_parallel=2), Recorder()
    replacer = ReplicaReplacer(replica_lists(manager)[0], recorder, enabled=True)
    assert not replacer.grow(2) and not replacer.grow(2)
    assert replacer.pending == 0 and len(manager.rollout_replicas) == 1
    (blocked,) = recorder.lines  # recorded once, not at every step's end
    assert blocked["event"] == "growth_blocked" and blocked["replicas"] == 1
    assert "2 free devices and 4 free CPUs on one node" in blocked["reason"]
    assert "node0000: 1 GPU, 16 CPU, node1000: 1 GPU, 16 CPU" in blocked["reason"]


@pytest.mark.parametrize(
    ("free", "per_node", "nodes", "placeable"),
    [
        (gpus(1.0, 1.0), 2, 1, False),  # 2 free in all, but no node has 2
        (gpus(1.0, 2.0), 2, 1, True),
        (gpus(2.0, cpus=3.0), 2, 1, False),  # verl's bundles take 2 CPUs per device: 4 needed
        (gpus(2.0, cpus=4.0), 2, 1, True),
        (gpus(4.0, 1.0), 2, 2, True),  # a replica over two nodes' worth: both groups fit on the first
        (gpus(3.0, 1.0), 2, 2, False),  # one group fits, the second nowhere
        ({}, 1, 1, False),  # no live node
    ],
)
def test_a_replica_is_placeable_only_where_a_node_holds_each_of_its_groups(free, per_node, nodes, placeable):
    from areal_plugins.driver.replica_replacement import placement_shortfall

    assert (placement_shortfall(free, per_node, nodes) is None) == placeable


def test_a_replacement_waits_a_bounded_time_for_a_node_with_its_devices():
    from areal_plugins.driver.replica_replacement import ReplicaNotPlacedError, wait_for_placement

    views = iter([gpus(1.0, 1.0), gpus(1.0, 1.0), gpus(2.0, 1.0)])  # the dead replica's placement group goes
    now = [0.0]
    wait_for_placement(2, 1, 60.0, free=lambda: next(views), clock=lambda: now[0], sleep=lambda s: None)
    with pytest.raises(ReplicaNotPlacedError, match=r"not placed within 10 s: a replica needs 2 free devices"):
        wait_for_placement(2, 1, 10.0, free=lambda: gpus(1.0, 1.0), clock=lambda: now[0],
                           sleep=lambda s: now.__setitem__(0, now[0] + s))  # fmt: skip


def test_a_start_past_its_time_is_abandoned_recorded_and_growth_looks_again(local_ray, monkeypatch):
    from areal_plugins.driver import replica_replacement

    monkeypatch.setattr(replica_replacement, "free_per_node", lambda: gpus(1.0))
    never = threading.Event()  # Ray never places it (before: the start thread waited forever, growth stopped)
    manager, recorder = stand_in_manager(never), Recorder()
    replacer = ReplicaReplacer(replica_lists(manager)[0], recorder, enabled=True, start_timeout_s=60.0)
    now = [100.0]
    replacer.clock = lambda: now[0]
    assert replacer.grow(3)
    now[0] += 59.0
    assert replacer.join() == 0 and replacer.pending == 1  # within its time: still starting
    now[0] += 2.0
    assert replacer.join() == 0 and replacer.pending == 0  # past it: abandoned
    timed_out = recorder.lines[-1]
    assert timed_out["event"] == "start_timed_out" and timed_out["replica"] == 1 and timed_out["waited_s"] == 61.0
    assert "did not start within 60 s" in timed_out["reason"]
    assert replacer.grow(3)  # the next step's end looks again
    never.set()  # the abandoned start finishes late: it is stopped, never joined
    replacer._starting[0][2].result(timeout=30)
    assert replacer.join() == 1 and [r.replica_rank for r in manager.rollout_replicas] == [0, 2]


def test_the_start_timeout_comes_from_the_recipe_else_from_the_measured_start():
    from areal_plugins.driver.replica_replacement import START_TIMEOUT_FACTOR

    replacer = ReplicaReplacer(replica_lists(SimpleNamespace(get_replicas=list))[0], Recorder(), enabled=True)
    assert replacer.start_timeout_from(None, None) is None
    assert replacer.start_timeout_from(None, 40.0) == START_TIMEOUT_FACTOR * 40.0
    assert replacer.start_timeout_from(900.0, 40.0) == 900.0


def test_a_dead_replicas_leftover_processes_are_the_recorded_ones_still_alive():
    from areal_plugins.driver.replica_replacement import leftovers

    recorded = [[10, 1000.0], [11, 1000.5], [12, 1001.0]]
    alive = {10: 1000.0, 11: 2000.0, 13: 1000.0}  # 11 is a later program under a reused pid; 12 is gone
    assert leftovers(recorded, alive) == [10]


def test_ending_leftovers_kills_only_the_recorded_processes(tmp_path):
    import psutil

    from areal_plugins.driver.replica_replacement import end_processes

    orphan = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])  # a vLLM worker left behind
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        started = psutil.Process(orphan.pid).create_time()
        other_started = psutil.Process(other.pid).create_time()
        assert end_processes([[orphan.pid, started], [other.pid, other_started + 5.0]]) == 1
        assert orphan.wait(timeout=10) == -signal.SIGKILL
        assert other.poll() is None  # its start time is not the recorded one: another program
    finally:
        other.kill()
        other.wait()


def test_a_dead_replicas_leftovers_are_ended_before_its_devices_are_freed(local_ray, monkeypatch):
    from areal_plugins.driver import replica_replacement

    order: list[str] = []
    monkeypatch.setattr(replica_replacement, "end_leftovers", lambda trees: order.append(f"end {trees}") or 2)
    monkeypatch.setattr(replica_replacement, "free_devices", lambda replica: order.append("free") or 1)
    manager, recorder = stand_in_manager(threading.Event()), Recorder()
    replacer = ReplicaReplacer(replica_lists(manager)[0], recorder, enabled=True)
    replacer._processes[1] = [{"node": "n", "processes": [[7, 1.0]]}]  # recorded while replica 1 served
    replacer.replace(SimpleNamespace(replica_rank=1, resource_pool=None))
    assert order == ["end [{'node': 'n', 'processes': [[7, 1.0]]}]", "free"]
    assert recorder.lines[0]["processes_ended"] == 2 and recorder.lines[0]["placement_groups_freed"] == 1


def test_what_the_placement_check_assumes_of_verls_standalone_replicas():
    """The placement check and the removal of an abandoned start's groups read verl 0.9.1's own choices: a standalone
    replica's pool reserves 2 CPUs with each device, packs each node's devices in one group, and names its groups
    after its rank. A verl that changes them fails here, not in a run that waits for the wrong thing."""
    import inspect

    from verl.single_controller.ray.base import RayResourcePool
    from verl.workers.rollout.replica import RolloutReplica

    from areal_plugins.driver.replica_replacement import CPUS_PER_DEVICE, PLACEMENT_GROUP_NAME

    standalone = inspect.getsource(RolloutReplica.init_standalone)
    assert f"max_colocate_count={int(CPUS_PER_DEVICE)}" in standalone
    assert 'resource_pool_name = f"rollout_pool_{self.replica_rank}{self.name_suffix}"' in standalone
    groups = inspect.getsource(RayResourcePool.get_placement_groups)
    assert 'bundle = {"CPU": self.max_colocate_count}' in groups and 'strategy="STRICT_PACK"' in groups
    assert "verl_group_" in groups and PLACEMENT_GROUP_NAME.startswith("rollout_pool_{rank}{suffix}verl_group_")
