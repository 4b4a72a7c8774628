"""A dead actor of the run stops the trainer's wait with its name; deliberate deaths do not."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from omegaconf import OmegaConf

from areal_plugins.driver.actor_liveness import ActorLiveness, RunActorDiedError, describe_actor


def actor(actor_id, class_name, state="ALIVE", reason=None, message=""):
    cause = {"actor_died_error_context": {"reason": reason, "error_message": message}} if reason else None
    return SimpleNamespace(actor_id=actor_id, class_name=class_name, state=state, pid=42, node_id="ab" * 14,
                           death_cause=cause)  # fmt: skip


class Cluster:
    def __init__(self, actors):
        self.actors = actors
        self.calls = 0

    def __call__(self):
        self.calls += 1
        return list(self.actors)


def test_an_actor_that_dies_after_the_start_is_named():
    cluster = Cluster([actor("a1", "AgentLoopWorkerTQ"), actor("t1", "TransferQueueController")])
    now = [0.0]
    liveness = ActorLiveness(cluster, interval_s=5, clock=lambda: now[0])
    liveness.check()  # the first look remembers who is alive
    now[0] = 5.0
    liveness.check()
    cluster.actors[0] = actor("a1", "AgentLoopWorkerTQ", "DEAD", "WORKER_DIED", "The actor died unexpectedly\nmore")
    now[0] = 7.0
    liveness.check()  # within the interval: no look at Ray
    assert cluster.calls == 2
    now[0] = 10.0
    expected = (
        r"areal: the agent-loop worker AgentLoopWorkerTQ \(pid 42, node abababab\) died \(WORKER_DIED: "
        r"The actor died unexpectedly\).*resume from the last checkpoint"
    )
    with pytest.raises(RunActorDiedError, match=expected):
        liveness.check()


def test_deliberate_deaths_and_later_actors_are_not_faults():
    cluster = Cluster([actor("a1", "Helper")])
    liveness = ActorLiveness(cluster, interval_s=0)
    liveness.check()
    cluster.actors = [actor("a1", "Helper", "DEAD", "OUT_OF_SCOPE"), actor("n1", "Later", "DEAD", "WORKER_DIED")]
    liveness.check()  # neither a dropped handle nor an actor born after the start stops the run


def test_a_death_the_run_survives_is_not_a_fault_and_any_other_still_is():
    # The replica pool says which deaths cost only capacity (a rollout server while another replica serves).
    cluster = Cluster([actor("s1", "CPURolloutServer"), actor("a1", "AgentLoopWorkerTQ")])
    liveness = ActorLiveness(cluster, interval_s=0, survivable=lambda actor_id: actor_id == "s1")
    liveness.check()
    cluster.actors[0] = actor("s1", "CPURolloutServer", "DEAD", "WORKER_DIED")
    liveness.check()
    cluster.actors[1] = actor("a1", "AgentLoopWorkerTQ", "DEAD", "WORKER_DIED")
    with pytest.raises(RunActorDiedError, match="agent-loop worker"):
        liveness.check()


def test_without_the_state_api_the_watchdog_remains():
    def broken():
        raise ConnectionError("dashboard not running")

    liveness = ActorLiveness(broken, interval_s=0)
    liveness.check()
    liveness.check()
    assert liveness.unavailable == "ConnectionError: dashboard not running"


def test_a_forced_look_ignores_the_interval():
    cluster = Cluster([actor("s1", "SimpleStorageUnit")])
    liveness = ActorLiveness(cluster, interval_s=3600, clock=lambda: 0.0)
    liveness.check(force=True)
    cluster.actors = [actor("s1", "SimpleStorageUnit", "DEAD", "WORKER_DIED")]
    liveness.check()  # on schedule: not yet
    with pytest.raises(RunActorDiedError, match="SimpleStorageUnit"):
        liveness.check(force=True)


def test_explain_waits_for_ray_to_mark_the_death():
    cluster = Cluster([actor("w1", "CPURolloutServer")])
    now = [0.0]
    liveness = ActorLiveness(cluster, interval_s=3600, clock=lambda: now[0])
    liveness.check(force=True)

    dies_at = [2.0]

    def sleep(seconds):  # Ray marks the actor dead two seconds after the caller saw the error
        now[0] += seconds
        if now[0] >= dies_at[0]:
            cluster.actors = [actor("w1", "CPURolloutServer", "DEAD", "WORKER_DIED")]

    with pytest.raises(RunActorDiedError, match="the rollout server CPURolloutServer"):
        liveness.explain(settle_s=5, sleep=sleep)
    cluster.actors = [actor("w1", "CPURolloutServer")]
    now[0], dies_at[0] = 100.0, float("inf")
    liveness.explain(settle_s=5, sleep=sleep)  # nobody died: returns after the settle time, the caller re-raises
    assert now[0] >= 105


def test_an_actor_created_after_the_first_look_is_watched_too():
    cluster = Cluster([actor("t1", "TaskRunnerV1")])
    liveness = ActorLiveness(cluster, interval_s=0)
    liveness.check()
    cluster.actors.append(actor("a1", "AgentLoopWorkerTQ"))  # verl starts its agent-loop workers later
    liveness.check()
    cluster.actors[1] = actor("a1", "AgentLoopWorkerTQ", "DEAD", "WORKER_DIED")
    with pytest.raises(RunActorDiedError, match="AgentLoopWorkerTQ"):
        liveness.check()


@pytest.mark.parametrize(
    ("class_name", "expected"),
    [
        ("create_colocated_worker_cls.<locals>.WorkerDict", "the trainer worker WorkerDict (pid 3, node 0123abcd)"),
        ("vLLMHttpServer", "the rollout server vLLMHttpServer (pid 3, node 0123abcd)"),
        ("SimpleStorageUnit", "the TransferQueue storage unit SimpleStorageUnit (pid 3, node 0123abcd)"),
        ("SomethingNew", "the actor SomethingNew (pid 3, node 0123abcd)"),
    ],
)
def test_a_dead_actor_is_named_by_its_role_in_the_run(class_name, expected):
    assert describe_actor(class_name, 3, "0123abcdef99") == expected


def test_a_rollout_server_found_dead_by_the_statistics_look_is_named_with_its_node(monkeypatch):
    # The step's look at the engines' statistics may see a lost node first: the run's error must still name it.
    from verl.trainer.ppo.v1.trainer_base import PPOTrainer

    from areal_plugins.driver.async_trainer import ArealAsyncTrainer
    from areal_plugins.driver.engine_stats import EngineStats, RolloutServerDiedError
    from areal_plugins.driver.replica_lists import ReplicaLists
    from areal_plugins.driver.replica_pool import ReplicaPool
    from areal_plugins.driver.supervision import Supervisor
    from areal_plugins.records.writer import RunRecorder

    cluster = Cluster([actor("s1", "CPURolloutServer")])
    liveness = ActorLiveness(cluster)
    liveness.check()  # seen alive at the start

    def fit(self, agent_loop_manager):
        cluster.actors[0] = actor("s1", "CPURolloutServer", "DEAD", "NODE_DIED", "The node died")
        raise RolloutServerDiedError("a rollout server of areal_cpu (replicas [0]) died")

    monkeypatch.setattr(PPOTrainer, "fit", fit)
    # What fit does before verl's loop (tell the agent-loop workers what a checkpoint kept) has no part here.
    monkeypatch.setattr("areal_plugins.driver.async_trainer.prepare_workers", lambda *args, **kwargs: None)
    trainer = object.__new__(ArealAsyncTrainer)
    trainer.rollout_manager = None
    trainer.config = OmegaConf.create({"trainer": {"default_local_dir": "unused", "save_freq": -1}})
    trainer._resume_from = None
    trainer.recorder = RunRecorder()
    pool = ReplicaPool(ReplicaLists(lambda: None, lambda: None), RunRecorder(), survives=False, backend="areal_cpu")
    trainer.engine_stats = EngineStats("areal_cpu", pool, RunRecorder())
    trainer.supervisor = Supervisor(trainer, 60.0, trainer.engine_stats, RunRecorder(), lambda: None)
    trainer.supervisor.liveness = liveness
    with pytest.raises(RunActorDiedError, match=r"rollout server CPURolloutServer \(pid 42, node abababab\) died"):
        trainer.fit(SimpleNamespace(agent_loop_workers=[]))


def test_the_state_api_is_pinned_to_this_jobs_cluster_whatever_ray_address_says(monkeypatch):
    """Ray's state API lets ``RAY_ADDRESS`` override the address it is given, and ``local`` makes it guess; with
    another Ray instance on the machine it refused ("Found multiple active Ray instances", seen in a run here). The
    job's own cluster, found by its GCS address, is set where Ray's state API looks first."""
    from ray.dashboard import utils as dashboard_utils

    from areal_plugins.driver import actor_liveness

    asked = []
    monkeypatch.setattr(dashboard_utils, "ray_address_to_api_server_url", lambda gcs: asked.append(gcs) or "http://h:1")
    monkeypatch.setenv("RAY_ADDRESS", "local")
    monkeypatch.delenv(actor_liveness.API_SERVER_VARIABLE, raising=False)
    monkeypatch.setattr(actor_liveness, "_pinned_for", None)
    actor_liveness._pin_state_api_to("10.0.0.1:6379")
    actor_liveness._pin_state_api_to("10.0.0.1:6379")
    assert asked == ["10.0.0.1:6379"]  # once a cluster
    # Ray's own resolution now ends at this cluster's API server, RAY_ADDRESS=local notwithstanding.
    assert dashboard_utils.get_address_for_submission_client(None) == "http://h:1"
    assert dashboard_utils.get_address_for_submission_client("10.9.9.9:6379") == "http://h:1"
    actor_liveness._pin_state_api_to("10.0.0.2:6379")  # a process that joined another cluster since
    assert asked == ["10.0.0.1:6379", "10.0.0.2:6379"]
    monkeypatch.setattr(actor_liveness, "_pinned_for", None)
    monkeypatch.setenv(actor_liveness.API_SERVER_VARIABLE, "http://users-own:8265")
    actor_liveness._pin_state_api_to("10.0.0.3:6379")  # a user's own setting is theirs
    assert len(asked) == 2
