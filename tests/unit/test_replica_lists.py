"""A replica leaves and joins verl's two lists together (driver/replica_lists.py): the servers the trainer uses
(verl's ``LLMServerManager``) and the replicas whose checkpoint-engine workers each weight sync builds its group from
(verl's ``CheckpointEngineManager.replicas``, through its ``remove_replicas`` / ``add_replicas``).

The first test is the failure the clean-clone CI run met at 9a4991b (the integration test
``test_a_dead_replica_of_two_costs_capacity_not_the_run``): there the trainer gave verl's checkpoint manager to the
replacer only, the pool rebuilt the server manager's lists without calling ``remove_replicas``, and the dead
replica's ``CheckpointEngineWorker`` stayed in the group the staged sync (``areal_gloo``) built. It runs the
trainer's own wiring on ``placement: separate`` with our staged manager, real Ray actors standing for the servers
and the workers.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import ray


@ray.remote
class Part:
    """Stands for a replica's server or one of its checkpoint-engine workers."""

    def ping(self) -> str:
        return "pong"


class StandInReplica:
    """verl's ``RolloutReplica`` as the pool and the sync see it (hashable by identity, as verl's is)."""

    def __init__(self, replica_rank: int, config=None, model_config=None, gpus_per_node=None) -> None:
        self.replica_rank, self.resource_pool = replica_rank, None
        self.gpus_per_replica_node, self.nnodes = 0, 1  # this Ray has no GPU

    async def init_standalone(self) -> None:  # what verl's start makes: a server and two workers
        self.servers, self.workers = [Part.remote()], [Part.remote(), Part.remote()]
        self._server_handle, self._server_address = self.servers[0], f"s{self.replica_rank}"


class Balancer:
    def remove_servers(self, addresses: list) -> None:
        pass

    def add_servers(self, servers: dict) -> None:
        pass


def started(rank: int) -> StandInReplica:
    import asyncio

    replica = StandInReplica(rank)
    asyncio.run(replica.init_standalone())
    return replica


def server_manager(replicas: list) -> SimpleNamespace:
    manager = SimpleNamespace(
        rollout_replicas=replicas,
        server_handles=[r._server_handle for r in replicas],
        server_addresses=[r._server_address for r in replicas],
        rollout_replica_class=StandInReplica,
        rollout_config=SimpleNamespace(n_gpus_per_node=1),
        model_config=None,
        global_load_balancer=ray.remote(Balancer).remote(),
    )
    manager.get_replicas = lambda: manager.rollout_replicas
    return manager


def ids(handles: list) -> list[str]:
    return [handle._actor_id.hex() for handle in handles]


@pytest.fixture(scope="module", autouse=True)
def handles_collected_before_ray_shuts_down(local_ray):
    """Ray handles collected after this module's Ray shut down end the pytest process (test_replica_replacement)."""
    yield
    import gc

    gc.collect()


def test_a_dead_replicas_workers_leave_the_staged_syncs_group_and_its_replacement_joins_it_once(tmp_path):
    from verl.workers.config import CheckpointEngineConfig

    from areal_plugins.driver.async_trainer import ArealAsyncTrainer
    from areal_plugins.driver.placements import Separate
    from areal_plugins.records.writer import RunRecorder
    from areal_plugins.weight_sync.gloo import register_gloo_checkpoint_engine
    from areal_plugins.weight_sync.staged import StagedCheckpointEngineManager

    register_gloo_checkpoint_engine()
    replicas = [started(0), started(1)]
    manager = server_manager(replicas)
    # As Separate.setup builds them: our staged manager on verl's, holding the server manager's very list.
    placement = Separate()
    placement.server_manager = manager
    placement.checkpoint_manager = StagedCheckpointEngineManager(
        config=CheckpointEngineConfig(backend="areal_gloo"), actor_wg=None, replicas=manager.get_replicas()
    )
    staged = placement.checkpoint_manager
    trainer = object.__new__(ArealAsyncTrainer)
    trainer.placement, trainer.recorder = placement, RunRecorder(str(tmp_path))
    trainer.areal = SimpleNamespace(replace_dead_replicas=True)
    ArealAsyncTrainer._build_replica_pool(trainer, survives=True, backend="areal_gloo")  # the trainer's own wiring

    def group() -> list[str]:  # the workers the next staged sync sends to, as its update builds them
        return ids(staged._rollout_group()._workers)

    assert group() == ids(replicas[0].workers + replicas[1].workers)
    dead = replicas[1]
    ray.kill(dead.servers[0], no_restart=True)
    assert trainer.replica_pool.survivable(ids(dead.servers)[0])
    deadline = time.monotonic() + 30
    while not (dropped := trainer.replica_pool.prune()) and time.monotonic() < deadline:
        time.sleep(0.2)  # Ray reports the kill a moment later
    assert dropped == [1]
    assert group() == ids(replicas[0].workers)  # the dead replica's workers are out of the sync (9a4991b: still in)
    assert [r.replica_rank for r in manager.rollout_replicas] == [0]

    # Its replacement (replica 2) joins the next sync, once, in the servers' order; names follow replica ranks.
    trainer.replacer._starting[0][2].result(timeout=30)
    assert trainer.replacer.join() == 1
    replacement = manager.rollout_replicas[-1]
    assert replacement.replica_rank == 2 and [r.replica_rank for r in staged.replicas] == [0, 2]
    assert group() == ids(replicas[0].workers + replacement.workers)
    assert staged._worker_names()[-1] == "replica 2, its worker 1"


def replica(rank: int) -> StandInReplica:
    made = StandInReplica(rank)
    made._server_handle, made._server_address = f"handle {rank}", f"s{rank}"
    return made


def lists_over(replicas: list):
    from verl.checkpoint_engine.base import CheckpointEngineManager
    from verl.workers.config import CheckpointEngineConfig

    from areal_plugins.driver.replica_lists import ReplicaLists

    manager = SimpleNamespace(
        rollout_replicas=replicas,
        server_handles=[r._server_handle for r in replicas],
        server_addresses=[r._server_address for r in replicas],
    )
    manager.get_replicas = lambda: manager.rollout_replicas
    checkpoints = CheckpointEngineManager(CheckpointEngineConfig(backend="naive"), None, manager.get_replicas())
    return ReplicaLists(lambda: manager, lambda: checkpoints), manager, checkpoints


def test_an_addition_while_verl_still_shares_the_list_lands_once_and_both_stay_aligned():
    """verl's add_replicas extends in place and remove_replicas binds a new list: the first change is made while
    both managers hold one list, the later ones after they stopped sharing it."""
    lists, manager, checkpoints = lists_over([replica(0), replica(1)])
    assert checkpoints.replicas is manager.rollout_replicas  # as verl and our placement build them
    lists.add(replica(2))  # the list still shared: added once, not twice
    assert [r.replica_rank for r in checkpoints.replicas] == [r.replica_rank for r in manager.rollout_replicas]
    assert [r.replica_rank for r in manager.rollout_replicas] == [0, 1, 2]
    assert lists.remove(manager.rollout_replicas[1]) == "s1"
    lists.add(replica(3))
    assert [r.replica_rank for r in checkpoints.replicas] == [r.replica_rank for r in manager.rollout_replicas]
    assert [r.replica_rank for r in manager.rollout_replicas] == [0, 2, 3]
    assert manager.server_addresses == ["s0", "s2", "s3"]
    assert manager.server_handles == ["handle 0", "handle 2", "handle 3"]


def test_a_change_made_to_one_list_outside_is_named_at_the_next_change_before_it_changes_anything():
    from areal_plugins.driver.replica_lists import ReplicaListsDivergedError

    lists, manager, checkpoints = lists_over([replica(0), replica(1)])
    lists.remove(manager.rollout_replicas[1])
    checkpoints.replicas.append(replica(5))  # as an in-place edit of the server manager's list once did
    with pytest.raises(
        ReplicaListsDivergedError, match=r"before replica 4 is added, .* serves replicas \[0\] but .* syncs \[0, 5\]"
    ):
        lists.add(replica(4))
    # Named before anything of ours changed: the server manager's lists are as they were.
    assert [r.replica_rank for r in manager.rollout_replicas] == [0] and manager.server_addresses == ["s0"]
    with pytest.raises(ReplicaListsDivergedError, match=r"before replica 0 is removed"):
        lists.remove(manager.rollout_replicas[0])
    assert [r.replica_rank for r in manager.rollout_replicas] == [0]
