"""A rollout replica that dies (``placement: separate``): its requests continue elsewhere, the pool drops it.

Real Ray, verl's own load balancer and our client; the servers are stand-ins that return scripted tokens (a
model would add nothing here: the engine-side behaviour is the integration test's, test_replica_death.py).
"""

from __future__ import annotations

import asyncio
import os
import time
from types import SimpleNamespace

import pytest
import ray
from omegaconf import OmegaConf

from tests.unit.conftest import replica_lists


@ray.remote
class StandInServer:
    """Scripted answers, one per call: ``("tokens", [ids], version, stop)`` or ``("die",)``."""

    def __init__(self, script: list[tuple]) -> None:
        self.script = list(script)
        self.prompts: list[list[int]] = []

    async def generate(self, request_id, prompt_ids, sampling_params, **kwargs):
        from verl.workers.rollout.replica import TokenOutput

        self.prompts.append(list(prompt_ids))
        step = self.script.pop(0)
        if step[0] == "die":
            os._exit(1)  # as a SIGKILL: no answer, no cleanup
        _, ids, version, stop = step
        return TokenOutput(
            token_ids=ids,
            log_probs=[-0.5] * len(ids),
            stop_reason=stop,
            extra_fields={"global_steps": version, "token_versions": [version] * len(ids)},
        )

    def seen_prompts(self) -> list[list[int]]:
        return self.prompts

    def get_stats(self) -> dict:
        return {"busy_s": 2.0, "generated_tokens": 10, "in_flight": 1}


def balancer(servers: dict):
    from verl.workers.rollout.router import get_router_handle

    return get_router_handle(servers=servers)


def test_a_request_whose_server_dies_continues_on_another_keeping_its_tokens(local_ray):
    from areal_plugins.agent_loop.llm_client import InterruptibleLLMClient

    # Replica a answers 3 tokens and is interrupted (a weight update), then dies under the continuation;
    # replica b finishes the request under the next version.
    a = StandInServer.remote([("tokens", [11, 12, 13], 0, "aborted"), ("die",)])
    b = StandInServer.remote([("tokens", [14, 15, 16, 17, 18], 1, "length")])
    lb = balancer({"a": a})
    ray.get(lb.acquire_server.remote(request_id="r1"))  # r1 sticks to a (verl's sticky sessions) ...
    ray.get(lb.release_server.remote(server_id="a"))
    ray.get(lb.add_servers.remote({"b": b}))  # ... and b serves too
    config = OmegaConf.create({"actor_rollout_ref": {"rollout": {"name": "areal_cpu", "response_length": 8}}})
    client = InterruptibleLLMClient(config, lb)
    sampling = {"max_tokens": 8, "temperature": 1.0}
    output = asyncio.run(client.generate("r1", prompt_ids=[1, 2], sampling_params=sampling))
    assert output.token_ids == [11, 12, 13, 14, 15, 16, 17, 18]
    assert output.extra_fields["token_versions"] == [0, 0, 0, 1, 1, 1, 1, 1]
    assert output.extra_fields["num_interrupts"] == 1
    assert output.stop_reason == "length"
    # b continued the request from the prompt and a's 3 tokens, not from scratch; a left the load balancer.
    assert ray.get(b.seen_prompts.remote()) == [[1, 2, 11, 12, 13]]
    assert ray.get(lb.get_all_servers.remote()) == ["b"]


def test_with_no_server_left_the_request_fails_as_before(local_ray):
    from areal_plugins.agent_loop.llm_client import InterruptibleLLMClient

    a = StandInServer.remote([("die",)])
    lb = balancer({"a": a})
    config = OmegaConf.create({"actor_rollout_ref": {"rollout": {"name": "areal_cpu", "response_length": 8}}})
    client = InterruptibleLLMClient(config, lb)
    with pytest.raises(RuntimeError, match="No available servers"):  # the group fails; admission re-issues it
        asyncio.run(client.generate("r1", prompt_ids=[1], sampling_params={"max_tokens": 8}))


def kill(server) -> None:
    """``ray.kill`` and wait until Ray reports the actor dead (the kill itself is asynchronous)."""
    ray.kill(server, no_restart=True)
    with pytest.raises(ray.exceptions.RayActorError):
        for _ in range(100):
            ray.get(server.__ray_ready__.remote(), timeout=10)
            time.sleep(0.1)


class StandInReplica:
    """Hashable by identity, as verl's ``RolloutReplica`` is (verl's ``remove_replicas`` makes a set of them)."""

    def __init__(self, replica_rank: int, servers: list, workers: list) -> None:
        self.replica_rank, self.servers, self.workers, self.resource_pool = replica_rank, servers, workers, None


def replica_manager(servers: list, lb, workers: list | None = None) -> SimpleNamespace:
    workers = workers or [[] for _ in servers]
    replicas = [StandInReplica(rank, [server], workers[rank]) for rank, server in enumerate(servers)]
    manager = SimpleNamespace(
        rollout_replicas=replicas,
        server_handles=list(servers),
        server_addresses=[f"s{rank}" for rank in range(len(servers))],
        global_load_balancer=lb,
    )
    manager.get_replicas = lambda: manager.rollout_replicas
    return manager


def test_the_pool_drops_a_dead_replica_everywhere_and_stops_when_none_is_left(local_ray, tmp_path):
    from areal_plugins.driver.engine_stats import EngineStats
    from areal_plugins.driver.replica_pool import ReplicaPool, RolloutServerDiedError, actor_id
    from areal_plugins.records.writer import RunRecorder, read_jsonl

    servers = [StandInServer.remote([]) for _ in range(3)]
    lb = balancer({f"s{rank}": server for rank, server in enumerate(servers)})
    manager = replica_manager(servers, lb)
    lists, checkpoints = replica_lists(manager)
    pool = ReplicaPool(lists, RunRecorder(str(tmp_path)), survives=True, backend="areal_cpu")
    stats = EngineStats("areal_cpu", pool, RunRecorder(str(tmp_path)))
    assert stats.read()["generated_tokens"] == 30
    assert pool.prune() == []  # every server answers

    kill(servers[1])
    # The statistics skip it and tell the pool; its work stays counted (30 tokens), nothing of it in flight.
    total = stats.read()
    assert (total["generated_tokens"], total["in_flight"], total["replicas"]) == (30, 2, 2)
    assert pool.has_suspects
    assert pool.prune() == [1]
    # Gone from the servers and from verl's weight sync (its checkpoint manager's replicas), together.
    assert [r.replica_rank for r in manager.rollout_replicas] == [0, 2]
    assert [r.replica_rank for r in checkpoints.replicas] == [0, 2]
    assert manager.server_addresses == ["s0", "s2"] and len(manager.server_handles) == 2
    assert sorted(ray.get(lb.get_all_servers.remote())) == ["s0", "s2"]
    (event,) = read_jsonl(tmp_path / "replica_events.jsonl")
    assert (event["event"], event["replica"], event["replicas_left"]) == ("lost", 1, 2)
    assert pool.survivable(actor_id(servers[1]))  # the actor watch no longer stops the run for it

    kill(servers[0])
    assert pool.survivable(actor_id(servers[0]))  # replica 2 still serves
    assert pool.prune() == [0]
    kill(servers[2])
    assert not pool.survivable(actor_id(servers[2]))  # the last one
    with pytest.raises(RolloutServerDiedError, match=r"replica\(s\) \[2\] died .* no other replica is left"):
        pool.prune()


def test_colocated_engines_are_never_dropped(local_ray, tmp_path):
    from areal_plugins.driver.replica_pool import ReplicaPool, actor_id
    from areal_plugins.records.writer import RunRecorder

    servers = [StandInServer.remote([]) for _ in range(2)]
    manager = replica_manager(servers, balancer({"s0": servers[0], "s1": servers[1]}))
    pool = ReplicaPool(replica_lists(manager)[0], RunRecorder(str(tmp_path)), survives=False, backend="areal_cpu")
    kill(servers[0])
    assert not pool.survivable(actor_id(servers[0]))  # the actor watch stops the run, naming it
    assert pool.prune() == [] and len(manager.rollout_replicas) == 2  # nothing is dropped


def test_a_dead_checkpoint_engine_worker_drops_its_replica_and_every_part_of_it_goes(local_ray, tmp_path):
    """A replica whose weight receiver died cannot take the next version: it is dropped like a dead server, and
    its server (alive, perhaps with requests) is killed so that their callers fail over."""
    from areal_plugins.driver.replica_pool import ReplicaPool, actor_id
    from areal_plugins.records.writer import RunRecorder

    servers = [StandInServer.remote([]) for _ in range(2)]
    workers = [[StandInServer.remote([])] for _ in range(2)]  # stand-ins for verl's CheckpointEngineWorker
    manager = replica_manager(servers, balancer({"s0": servers[0], "s1": servers[1]}), workers)
    lists, checkpoints = replica_lists(manager)
    pool = ReplicaPool(lists, RunRecorder(str(tmp_path)), survives=True, backend="areal_cpu")
    assert not pool.survivable("an actor of no replica")  # an agent-loop worker, the load balancer, ...
    kill(workers[0][0])
    assert pool.survivable(actor_id(workers[0][0]))
    assert pool.prune() == [0]
    assert [r.replica_rank for r in manager.rollout_replicas] == [r.replica_rank for r in checkpoints.replicas] == [1]
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(servers[0].__ray_ready__.remote(), timeout=30)
    assert pool.survivable(actor_id(servers[0]))  # its death, which we caused, stops nothing


def test_only_a_checkpoint_engine_that_rebuilds_its_group_lets_a_replica_go():
    from areal_plugins.driver.replica_pool import weight_group_rebuilt_each_sync

    def rollout(backend: str, **kwargs) -> object:
        engine = {"backend": backend, "engine_kwargs": {backend: kwargs} if kwargs else {}}
        return OmegaConf.create({"checkpoint_engine": engine})

    assert weight_group_rebuilt_each_sync(rollout("areal_gloo"))
    assert not weight_group_rebuilt_each_sync(rollout("nccl"))  # verl keeps its NCCL group across syncs
    assert weight_group_rebuilt_each_sync(rollout("nccl", rebuild_group=True))
