"""The order of a staged weight update (weight_sync/staged.py): the transfer runs while the engines generate,
and they are paused only for the load. The worker groups and replicas are stand-ins that log what is asked of
them; the manager is ours on verl's ``CheckpointEngineManager``, whose own order is the comparison."""

from __future__ import annotations

import json

import pytest
import ray
import verl.checkpoint_engine.base as verl_base

from areal_plugins.weight_sync import staged
from areal_plugins.weight_sync.checked_transfer import WeightSyncError


class Log(list):
    def index_of(self, event: str) -> int:
        return self.index(event)


#: Checksums ([elements, Σx, Σx², Σwx]) of what the trainer's rank 0 sent, and of what each rollout worker got.
SENT = {"embed": [4.0, 1.5, 2.25, 0.3], "norm": [2.0, 2.0, 2.0, 0.1]}


class ActorGroup:
    world_size = 2

    def __init__(self, log: Log) -> None:
        self.log = log
        self.reports = [{"rank": 0, "sent": SENT, "received": {}}, {"rank": -1, "sent": {}, "received": {}}]

    def update_weights(self, global_steps=None, mode=None):
        self.log.append("trainer sends")
        return [{"sent_s": 1.0}, None]

    def execute_checkpoint_engine(self, method, *args, **kwargs):  # one name per rank, as verl dispatches
        self.log.append(f"trainer {method[0]}")
        return self.reports if method[0] == "areal_transfer_checksums" else [{} for _ in method]


class RolloutGroup:
    #: what rollout worker 3 receives instead of SENT["norm"] (None: the same)
    norm_on_worker_3: list[float] | None = None

    def __init__(self, log: Log, worker_handles, ray_cls_with_init=None) -> None:
        self.log, self.world_size = log, len(worker_handles)

    def execute_checkpoint_engine(self, method, *args, **kwargs):
        self.log.append(f"rollout {method[0]}")
        if method[0] == "areal_transfer_checksums":
            reports = [{"rank": rank, "sent": {}, "received": dict(SENT)} for rank in range(1, self.world_size + 1)]
            if self.norm_on_worker_3 is not None:
                reports[2]["received"]["norm"] = self.norm_on_worker_3
            return reports
        return [1234 if name == "stage" else {} for name in method]

    def update_weights(self, global_steps=None):
        self.log.append("rollout loads")
        return [None] * self.world_size


class Replica:
    def __init__(self, log: Log, replica_rank: int) -> None:
        self.log, self.workers, self.replica_rank = log, ["worker 0", "worker 1"], replica_rank

    async def abort_all_requests(self, reject_request: bool = False):
        self.log.append("engines aborted")

    async def resume_generation(self):
        self.log.append("engines resumed")

    async def release_kv_cache(self):
        self.log.append("kv released")

    async def resume_kv_cache(self):
        self.log.append("kv restored")


class Staging:
    stages_weights = True

    def stage(self, global_steps=None) -> int:
        return 0

    @classmethod
    def build_topology(cls, actor_world_size, rollout_world_size, metadata):
        return {}, {}


class Streaming(Staging):  # as verl's nccl: no stage
    stages_weights = False


class CheckedStaging(Staging):  # as areal_gloo
    reports_transfer_checksums = True


class CheckedStreaming(Streaming):  # as verl's nccl with our mixin (weight_sync/checked_transfer.py)
    reports_transfer_checksums = True


def manager(log: Log, backend_cls: type, monkeypatch, tmp_path) -> staged.StagedCheckpointEngineManager:
    monkeypatch.setattr(ray, "get", lambda values: values)
    group = lambda worker_handles, ray_cls_with_init=None: RolloutGroup(log, worker_handles)  # noqa: E731
    monkeypatch.setattr(staged, "RayWorkerGroup", group)
    monkeypatch.setattr(verl_base, "RayWorkerGroup", group)
    monkeypatch.setenv("AREAL_RUN_DIR", str(tmp_path))
    built = staged.StagedCheckpointEngineManager.__new__(staged.StagedCheckpointEngineManager)
    built.backend, built.backend_cls = "areal_gloo", backend_cls
    # replica 1 died and was replaced by replica 2: names are replica ranks, not positions
    built.actor_wg, built.replicas = ActorGroup(log), [Replica(log, 0), Replica(log, 2)]
    built.before_pause = lambda: log.append("admission stopped")
    return built


def test_a_staging_engine_transfers_while_the_engines_generate_and_pauses_them_only_for_the_load(monkeypatch, tmp_path):
    log = Log()
    metrics = manager(log, Staging, monkeypatch, tmp_path).update_weights(global_steps=4)
    # the whole transfer (the trainer's send and every worker's stage) ends before any engine is aborted, and
    # prompts are submitted until then: the trainer's admission stops just before the abort
    assert log.index_of("trainer sends") < log.index_of("admission stopped") < log.index_of("engines aborted")
    assert log.index_of("rollout stage") < log.index_of("admission stopped")
    # paused: abort, load from the stages, resume; nothing else is transferred in between
    paused = log[log.index_of("engines aborted") : len(log) - log[::-1].index("engines resumed")]
    assert "rollout loads" in paused and "trainer sends" not in paused and "rollout stage" not in paused
    assert metrics == {"sent_s": 1.0}  # the trainer's per-sync metrics, as verl returns them
    (record,) = [json.loads(line) for line in (tmp_path / staged.RECORD).read_text().splitlines()]
    assert record["version"] == 4 and record["workers"] == 4 and record["staged_bytes_per_worker"] == 1234


@pytest.mark.parametrize("backend", ["streaming", "naive"])
def test_other_checkpoint_engines_keep_verls_order(backend, monkeypatch, tmp_path):
    log = Log()
    built = manager(log, Streaming, monkeypatch, tmp_path)
    if backend == "naive":
        built.backend = "naive"
        built.actor_wg.update_weights = lambda global_steps=None, mode=None: log.append(f"trainer {mode} sync")
        built.update_weights(global_steps=4)
        assert log == ["admission stopped", "trainer naive sync"]
        return
    built.update_weights(global_steps=4)
    assert log.index_of("engines aborted") < log.index_of("trainer sends")  # verl's: paused for the transfer
    assert log[0] == "admission stopped"
    assert "rollout stage" not in log and not (tmp_path / staged.RECORD).exists()


@pytest.mark.parametrize("backend_cls", [CheckedStaging, CheckedStreaming])
def test_what_every_rollout_worker_received_is_compared_with_what_the_trainer_sent(backend_cls, monkeypatch, tmp_path):
    log = Log()
    manager(log, backend_cls, monkeypatch, tmp_path).update_weights(global_steps=4)
    assert "rollout areal_transfer_checksums" in log and "trainer areal_transfer_checksums" in log
    monkeypatch.setattr(RolloutGroup, "norm_on_worker_3", [2.0, 2.0, 2.0, 0.6])  # two values swapped on the way
    log.clear()
    # rank 3 is the third of the group's workers [replica 0: 2 workers, replica 2: 2]: replica 2's first
    with pytest.raises(
        WeightSyncError, match=r"rollout worker rank 3 \(replica 2, its worker 0\): tensor norm arrived"
    ):
        manager(log, backend_cls, monkeypatch, tmp_path).update_weights(global_steps=5)
    if backend_cls is CheckedStaging:  # staged: stopped before any engine was paused or loaded, stages freed
        assert "engines aborted" not in log and "rollout loads" not in log
        assert log[-2:] == ["trainer finalize", "rollout finalize"]


def test_a_failed_update_reports_its_own_error_even_when_finalizing_fails_too(monkeypatch, tmp_path):
    log = Log()
    built = manager(log, CheckedStaging, monkeypatch, tmp_path)
    monkeypatch.setattr(RolloutGroup, "norm_on_worker_3", [2.0, 2.0, 2.0, 0.6])
    finalize = RolloutGroup.execute_checkpoint_engine

    def dead_worker(self, method, *args, **kwargs):
        if method[0] == "finalize":
            raise RuntimeError("the actor died")
        return finalize(self, method, *args, **kwargs)

    monkeypatch.setattr(RolloutGroup, "execute_checkpoint_engine", dead_worker)
    with pytest.raises(WeightSyncError, match="tensor norm arrived different"):
        built.update_weights(global_steps=5)


@pytest.mark.parametrize("in_flight", ["interrupt", "wait"])
def test_with_in_flight_wait_the_requests_under_way_finish_after_the_transfer_and_before_the_abort(
    in_flight, monkeypatch, tmp_path
):
    """The separate placement's ``before_pause`` (driver/placements.py ``stop_admission``) on a staged update:
    ``wait`` keeps the transfer beside generation and lets the 2 groups under way finish before the engines are
    aborted; ``interrupt`` aborts them."""
    import functools
    from contextlib import nullcontext
    from types import SimpleNamespace

    from areal_plugins.driver.placements import placement_for

    log = Log()
    running = SimpleNamespace(running=2)

    def settle_one() -> None:  # the admission thread, settling a group that finished
        running.running -= 1
        log.append("group finished")

    trainer = SimpleNamespace(
        rollout_manager=SimpleNamespace(
            staleness_controller=running, pause=lambda: log.append("admission stopped"), check_alive=settle_one
        ),
        supervisor=SimpleNamespace(waiting=lambda: lambda: None),
        recorder=SimpleNamespace(span=lambda *args, **kwargs: nullcontext()),
        timing_raw={},
    )
    built = manager(log, Staging, monkeypatch, tmp_path)
    built.before_pause = functools.partial(placement_for("separate", in_flight, 0.001).stop_admission, trainer)
    built.update_weights(global_steps=4)
    aborted = log.index_of("engines aborted")
    assert log.index_of("rollout stage") < log.index_of("admission stopped") < aborted
    if in_flight == "wait":
        between = [event for event in log[log.index_of("admission stopped") : aborted] if event != "admission stopped"]
        assert between == ["group finished", "group finished"]
    else:
        assert "group finished" not in log and running.running == 2
