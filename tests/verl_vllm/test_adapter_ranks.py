"""The weight check of verl's vllm adapter under tensor parallelism, with ``RANK`` set as verl sets it.

Needs vLLM importable (verl's adapter module imports it), so it runs in ``.venv-verl-vllm``
(tools/test.sh). No engine is started: the transport is verl's part, replaced here by a function that
consumes the weights as verl's bucketed sender does, and the server actor by an object with its one method.
With TP = 2, every trainer rank sends the full tensors to its own vLLM worker; only the replica's first
rank holds the server handle, so only it reads the reports, and they cover every worker of its replica.
"""

from __future__ import annotations

import asyncio
import json
import types

import pytest
import ray
import torch
from verl.workers.config import RolloutConfig
from verl.workers.rollout.utils import ensure_async_iterator
from verl.workers.rollout.vllm_rollout.vllm_rollout import ServerAdapter

from areal_plugins.rollout.verl_vllm.adapter import ArealServerAdapter
from areal_plugins.weight_sync.checksums import tensor_checksum
from areal_plugins.weight_sync.errors import WeightSyncError

TP = 2
WEIGHTS = {"model.norm.weight": torch.linspace(0.5, 1.5, 8), "lm_head.weight": torch.arange(12.0).reshape(3, 4)}


class FakeServer:
    """The server actor's handle as the adapter uses it: ``areal_weight_reports.remote()``, awaited."""

    def __init__(self, reports: list[dict]) -> None:
        self.calls = 0

        async def answer() -> list[dict]:
            self.calls += 1
            return reports

        self.areal_weight_reports = types.SimpleNamespace(remote=answer)


def worker_report(rank: int, corrupt: str | None = None) -> dict:
    checksums = {}
    for name, tensor in WEIGHTS.items():
        received = tensor.clone()
        if name == corrupt:
            received.view(-1)[0] += 1.0
        checksums[name] = tensor_checksum(received)
    # After loading: the norm held as received; the linear layer repacked by the engine (not readable, not compared).
    norm = checksums["model.norm.weight"]
    entries = {"model.norm.weight": {"held": norm, "expected": norm, "sharded": False}}
    loaded = {"entries": entries, "unchecked": ["lm_head.weight"], "not_held": []}
    return {"rank": rank, "checksums": checksums, "loaded": loaded}


@pytest.fixture
def adapter_at(monkeypatch, tmp_path):
    """An adapter for trainer ``rank`` of a run with 4 trainer ranks on one node and TP = 2 (2 replicas)."""
    monkeypatch.setattr(ray, "get_runtime_context", lambda: types.SimpleNamespace(get_job_id=lambda: "01000000"))
    monkeypatch.setenv("RAY_LOCAL_WORLD_SIZE", "4")
    monkeypatch.setenv("AREAL_RUN_DIR", str(tmp_path))
    transported: list[list[str]] = []

    async def verl_transport(self, weights, global_steps=None, wire_format="named_tensors", **kwargs):
        names = []
        async for name, _tensor in ensure_async_iterator(weights):  # as verl's bucketed sender takes them
            names.append(name)
        transported.append(names)

    monkeypatch.setattr(ServerAdapter, "update_weights", verl_transport)

    def make(rank: int, reports: list[dict] | None) -> tuple[ArealServerAdapter, FakeServer | None]:
        monkeypatch.setenv("RANK", str(rank))
        adapter = ArealServerAdapter(
            RolloutConfig(name="vllm", tensor_model_parallel_size=TP), types.SimpleNamespace(), None
        )
        server = FakeServer(reports) if reports is not None else None
        adapter.server_handle = server
        return adapter, server

    make.transported = transported
    return make


def update(adapter: ArealServerAdapter, version: int = 3) -> None:
    asyncio.run(adapter.update_weights(iter(WEIGHTS.items()), global_steps=version))


def test_verl_maps_ranks_to_replicas_and_one_leader_each(adapter_at):
    seen = [(a.replica_rank, a.rollout_rank, a._has_server) for a, _ in (adapter_at(r, None) for r in range(4))]
    assert seen == [(0, 0, True), (0, 1, False), (1, 0, True), (1, 1, False)]


def test_the_replica_leader_compares_every_workers_report(adapter_at, tmp_path):
    adapter, server = adapter_at(2, [worker_report(0), worker_report(1)])
    update(adapter)
    assert server.calls == 1
    assert adapter_at.transported == [list(WEIGHTS)]  # the weights went through verl's transport, all of them
    (record,) = [json.loads(line) for line in (tmp_path / "weight_syncs.jsonl").read_text().splitlines()]
    assert record["replica"] == 1 and record["version"] == 3 and record["event"] == "update_checked"
    assert record["checksum"] == {
        "tensors": 2,
        "workers": [0, 1],
        "loaded_compared": 1,
        "loaded_not_compared": 1,
        "loaded_not_compared_examples": ["lm_head.weight"],
    }


def test_a_tensor_corrupted_on_the_second_tp_worker_is_named(adapter_at):
    adapter, _ = adapter_at(2, [worker_report(0), worker_report(1, corrupt="lm_head.weight")])
    with pytest.raises(WeightSyncError, match=r"rollout replica 1, vLLM worker rank 1: tensor lm_head\.weight arrived"):
        update(adapter)


def test_a_second_tp_rank_only_sends_and_never_asks_the_server(adapter_at, tmp_path):
    adapter, _ = adapter_at(1, None)  # verl gives it no server handle; asking would fail
    update(adapter)
    assert adapter_at.transported == [list(WEIGHTS)]
    assert not (tmp_path / "weight_syncs.jsonl").exists()


def test_a_worker_missing_from_the_reports_is_refused(adapter_at):
    adapter, _ = adapter_at(0, [worker_report(0)])  # TP = 2, one report
    with pytest.raises(WeightSyncError):
        update(adapter)


def test_a_load_that_stops_part_way_closes_the_transports_weights_at_once(adapter_at, monkeypatch):
    # A streaming transport (areal_gloo without a stage) takes the rest of its update when closed, so that its
    # sender is not left waiting; the adapter must close it when verl's transport fails, not leave it to the GC.
    closed = []

    def received():
        try:
            yield from WEIGHTS.items()
        finally:
            closed.append("closed")

    async def engine_dies(self, weights, global_steps=None, wire_format="named_tensors", **kwargs):
        async for _name, _tensor in ensure_async_iterator(weights):
            raise RuntimeError("the engine died mid-load")

    monkeypatch.setattr(ServerAdapter, "update_weights", engine_dies)
    adapter, _ = adapter_at(2, [worker_report(0), worker_report(1)])
    weights = received()  # held here: the garbage collector cannot close it for the adapter
    with pytest.raises(RuntimeError, match="engine died"):
        asyncio.run(adapter.update_weights(weights, global_steps=3))
    assert closed == ["closed"]
