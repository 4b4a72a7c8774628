"""A dead replica's replacement: started in the background, in the weight sync's list before the next sync, in the
load balancer only after it (real Ray actors stand for the servers and verl's load balancer; the integration test
``test_a_dead_replica_of_two_costs_capacity_not_the_run`` runs it through verl)."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import ray

from areal_plugins.driver.replica_replacement import ReplicaReplacer


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


def stand_in_manager(started: threading.Event, fails: bool = False) -> SimpleNamespace:
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
    return SimpleNamespace(
        rollout_replicas=[survivor], server_handles=[None], server_addresses=["server-0"],
        rollout_replica_class=StandInReplica, model_config=None,
        rollout_config=SimpleNamespace(n_gpus_per_node=1, tensor_model_parallel_size=1, data_parallel_size=1,
                                       pipeline_model_parallel_size=1),
        global_load_balancer=ray.remote(Balancer).remote(),
    )  # fmt: skip


def test_a_replacement_joins_the_sync_once_started_and_takes_requests_only_after_it(local_ray):
    placed = threading.Event()
    manager, recorder = stand_in_manager(placed), Recorder()
    replacer = ReplicaReplacer(lambda: manager, recorder, enabled=True)
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
    replacer = ReplicaReplacer(lambda: manager, recorder, enabled=True)
    replacer.replace(SimpleNamespace(replica_rank=1, resource_pool=None))
    replacer._starting[0][2].exception(timeout=30)
    assert replacer.join() == 0 and len(manager.rollout_replicas) == 1 and replacer.pending == 0
    assert recorder.lines[-1]["event"] == "start_failed" and "no device left" in recorder.lines[-1]["reason"]


def test_with_replacement_off_a_dead_replica_is_only_dropped(local_ray):
    manager, recorder = stand_in_manager(threading.Event()), Recorder()
    replacer = ReplicaReplacer(lambda: manager, recorder, enabled=False)
    replacer.replace(SimpleNamespace(replica_rank=1, resource_pool=None))
    assert replacer.pending == 0 and recorder.lines == []


def test_a_replacement_waits_until_ray_has_its_devices_free(monkeypatch):
    from areal_plugins.driver import replica_replacement

    free = iter([0.0, 0.0, 1.0, 2.0])  # the dead replica's placement group is going; then a node joins
    looks: list[float] = []

    def count() -> float:
        looks.append(next(free))
        return looks[-1]

    monkeypatch.setattr(replica_replacement, "free_device_count", count)
    monkeypatch.setattr(replica_replacement, "WAIT_FOR_DEVICES_S", 0.0)
    replica_replacement.wait_for_devices(2)
    assert looks == [0.0, 0.0, 1.0, 2.0]


def test_the_replicas_grow_to_their_limit_when_ray_has_the_devices_for_one_more(local_ray, monkeypatch):
    from areal_plugins.driver import replica_replacement

    free = {"devices": 0.0}
    monkeypatch.setattr(replica_replacement, "free_device_count", lambda: free["devices"])
    placed = threading.Event()
    placed.set()
    manager, recorder = stand_in_manager(placed), Recorder()
    replacer = ReplicaReplacer(lambda: manager, recorder, enabled=True)
    assert not replacer.grow(None) and not replacer.grow(3)  # no limit set; no free device
    free["devices"] = 1.0  # a node with one device joined
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
    assert [line["event"] for line in recorder.lines] == ["growing", "joined", "growing", "joined"]
