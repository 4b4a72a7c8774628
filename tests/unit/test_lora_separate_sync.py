"""LoRA adapter-only through a checkpoint engine (placement: separate): the stream, the trainer's patch, and the verl
0.9.1 behaviour it replaces (pinned: when verl PR #7496 lands, the pins fail and the patch is to go).

The stream's layout (weight_sync/lora_updates.py) is written out here by hand; the patch runs against a stand-in of
verl's worker that records which parameters it asked its engine for (the real worker runs in
tests/integration/test_lora.py).
"""

from __future__ import annotations

import asyncio
import inspect
import pickle
from types import SimpleNamespace

import pytest
import torch

from areal_plugins.weight_sync.errors import WeightSyncError
from areal_plugins.weight_sync.lora_updates import (
    ADAPTER_FOLLOWS,
    HEADER,
    load_lora_update,
    lora_update_stream,
    read_lora_update,
)

PEFT = {"r": 8, "lora_alpha": 16, "target_modules": {"q_proj", "v_proj"}}  # a set, as peft's to_dict() gives
BASE = [("model.layers.0.q_proj.base_layer.weight", torch.ones(2, 2)), ("model.norm.weight", torch.zeros(2))]
ADAPTER = [("model.layers.0.q_proj.lora_A.weight", torch.full((8, 2), 0.5))]


async def _collect(stream):
    return [(name, tensor) async for name, tensor in stream]


def test_the_stream_is_header_base_marker_adapter():
    names = [name for name, _ in lora_update_stream(BASE, ADAPTER, PEFT)]
    assert names == [HEADER, BASE[0][0], BASE[1][0], ADAPTER_FOLLOWS, ADAPTER[0][0]]
    header = next(iter(lora_update_stream(None, ADAPTER, PEFT)))[1]
    assert header.dtype == torch.uint8
    assert pickle.loads(bytes(header.tolist())) == {"peft_config": PEFT, "base": False}
    assert [name for name, _ in lora_update_stream(None, ADAPTER, PEFT)] == [HEADER, ADAPTER[0][0]]


@pytest.mark.parametrize("with_base", [True, False])
def test_the_rollout_side_reads_back_the_parts_it_was_sent(with_base):
    async def read():
        update = await read_lora_update(lora_update_stream(BASE if with_base else None, ADAPTER, PEFT))
        base = await _collect(update.base()) if update.has_base else []
        return update, base, await _collect(update.adapter())

    update, base, adapter = asyncio.run(read())
    assert update.peft_config == PEFT and update.has_base is with_base
    assert [name for name, _ in base] == ([name for name, _ in BASE] if with_base else [])
    assert [name for name, _ in adapter] == [ADAPTER[0][0]]
    assert torch.equal(adapter[0][1], ADAPTER[0][1])


def test_every_tensor_after_the_markers_stays_aligned_in_verls_buckets():
    """verl's nccl engine and vLLM IPC sender pack tensors back to back in a uint8 bucket
    (``split_weight_chunks``) and view each slice as its dtype (``merge_weight_chunks``): a slice at an offset its
    element size does not divide cannot be viewed. fp32 and bf16 tensors after the header and the marker."""
    from verl.checkpoint_engine.base import merge_weight_chunks, split_weight_chunks

    base = [*BASE, ("model.layers.0.mlp.up_proj.base_layer.weight", torch.ones(8, dtype=torch.bfloat16))]
    adapter = [("model.layers.0.q_proj.lora_B.weight", torch.full((3, 8), 0.25, dtype=torch.float64)), *ADAPTER]

    async def through_one_bucket():
        parts = [(meta, chunk.clone()) async for meta, chunk in split_weight_chunks(
            lora_update_stream(base, adapter, PEFT), 1 << 20)]  # fmt: skip
        bucket, offset, sliced = torch.cat([chunk for _, chunk in parts]), 0, []
        for meta, chunk in parts:
            sliced.append((meta, bucket[offset : offset + chunk.numel()]))
            offset += chunk.numel()

        async def chunks():
            for item in sliced:
                yield item

        update = await read_lora_update(merge_weight_chunks(chunks(), 1 << 20))
        return update, await _collect(update.base()), await _collect(update.adapter())

    update, got_base, got_adapter = asyncio.run(through_one_bucket())
    assert update.peft_config == PEFT
    assert [(n, t.dtype) for n, t in got_base] == [(n, t.dtype) for n, t in base]
    assert all(torch.equal(a[1], b[1]) for a, b in zip(got_adapter, adapter, strict=True))


def test_a_stream_without_header_comes_back_whole():
    async def read():
        update = await read_lora_update(iter(BASE))
        return update, await _collect(update.rest())

    update, rest = asyncio.run(read())
    assert update.peft_config is None
    assert [name for name, _ in rest] == [name for name, _ in BASE]


def test_a_server_adapter_loads_a_lora_stream_as_verls_two_colocated_calls():
    """load_lora_update, what both our server adapters call: the base with base_sync_done=False, then the adapter
    with True, each with the header's peft_config; a plain stream, or verl's own colocated call, comes back whole."""
    calls = []

    async def load(weights, **kwargs):
        calls.append(([name async for name, _ in weights], kwargs))
        return "loaded"

    async def run(stream, kwargs):
        handled, outcome = await load_lora_update(stream, kwargs, load)
        return handled, outcome if handled else [name async for name, _ in outcome]

    assert asyncio.run(run(lora_update_stream(BASE, ADAPTER, PEFT), {"global_steps": 3})) == (True, "loaded")
    assert calls == [
        ([name for name, _ in BASE], {"global_steps": 3, "peft_config": PEFT, "base_sync_done": False}),
        ([ADAPTER[0][0]], {"global_steps": 3, "peft_config": PEFT, "base_sync_done": True}),
    ]
    calls.clear()
    assert asyncio.run(run(iter(BASE), {})) == (False, [name for name, _ in BASE]) and calls == []
    colocated = {"peft_config": PEFT, "base_sync_done": True}
    handled, outcome = asyncio.run(load_lora_update(iter(ADAPTER), colocated, load))
    assert handled is False and [name for name, _ in outcome] == [ADAPTER[0][0]] and calls == []


def test_a_base_without_its_marker_stops_the_update():
    stream = [*list(lora_update_stream(BASE, ADAPTER, PEFT))[:3]]  # header and base; marker and adapter lost

    async def read():
        update = await read_lora_update(iter(stream))
        return await _collect(update.base())

    with pytest.raises(WeightSyncError, match=r"no areal\.lora_update\.adapter_follows marker"):
        asyncio.run(read())


# --- the trainer's patch, on a stand-in of verl's ActorRolloutRefWorker ------------------------------------------


class RecordingEngine:
    """What verl's FSDP engine returns for a LoRA model: the adapter (``base_sync_done=True``) or the base."""

    def __init__(self) -> None:
        self.module = SimpleNamespace(peft_config={"default": object()})
        self.calls: list[bool] = []

    def get_per_tensor_param(self, layered_summon=False, base_sync_done=False):
        if layered_summon and not base_sync_done:  # as verl's collect_lora_params refuses it
            raise ValueError("layered_summon for the base")
        self.calls.append(base_sync_done)
        return (iter(ADAPTER), PEFT) if base_sync_done else (iter(BASE), PEFT)


class RecordingCheckpointEngine:
    def __init__(self) -> None:
        self.sent: list[list[str]] = []

    async def send_weights(self, weights, global_steps=None):
        self.sent.append([name for name, _ in weights])
        return {"sent": len(self.sent[-1])}


def stand_in_worker(backend="areal_gloo", merge=False, load_format="dummy"):
    """verl's worker as the separate placement builds it: role ``actor`` alone, so none of the rollout-side
    attributes (``base_sync_done``, ``peft_merge``, ``layered_summon``) exist on it."""
    rollout = {"checkpoint_engine": SimpleNamespace(backend=backend), "load_format": load_format,
               "layered_summon": True}  # fmt: skip
    return SimpleNamespace(
        config=SimpleNamespace(rollout=DictLike(rollout), model=DictLike({"lora": {"merge": merge}})),
        actor=SimpleNamespace(engine=RecordingEngine()),
        checkpoint_engine=RecordingCheckpointEngine(),
    )


class DictLike(SimpleNamespace):
    """An OmegaConf node's two ways in: attributes and ``get``."""

    def __init__(self, values: dict) -> None:
        super().__init__(**values)

    def get(self, key, default=None):
        return getattr(self, key, default)


def patched_update(worker, mode="auto"):
    from areal_plugins.patches import lora_separate_sync

    calls = []

    async def original(self, global_steps=None, mode="auto"):
        calls.append(mode)
        return {"verl": True}

    update = lora_separate_sync._make_replacement(original)
    return asyncio.run(update(worker, global_steps=3, mode=mode)), calls


def test_the_base_goes_once_then_the_adapter_alone_on_every_update():
    worker = stand_in_worker()
    base_names, adapter_names = [name for name, _ in BASE], [name for name, _ in ADAPTER]
    patched_update(worker)
    patched_update(worker)
    assert worker.checkpoint_engine.sent == [
        [HEADER, *base_names, ADAPTER_FOLLOWS, *adapter_names],
        [HEADER, *adapter_names],
    ]
    assert worker._areal_lora_base_sent is True


def test_engines_started_from_real_weights_get_no_base_and_a_replacement_gets_it_again():
    from areal_plugins.weight_sync.lora_updates import RESEND_BASE_ATTRIBUTE

    worker = stand_in_worker(load_format="auto")
    patched_update(worker)
    assert worker.checkpoint_engine.sent[-1] == [HEADER, ADAPTER[0][0]]
    setattr(worker.checkpoint_engine, RESEND_BASE_ATTRIBUTE, True)  # what StagedCheckpointEngineManager sets
    patched_update(worker)
    assert ADAPTER_FOLLOWS in worker.checkpoint_engine.sent[-1]
    patched_update(worker)
    assert worker.checkpoint_engine.sent[-1] == [HEADER, ADAPTER[0][0]]


@pytest.mark.parametrize(
    ("backend", "merge", "mode"), [("naive", False, "auto"), ("areal_gloo", True, "auto"), ("nccl", False, "naive")]
)
def test_everything_else_is_verls_own_update(backend, merge, mode):
    worker = stand_in_worker(backend=backend, merge=merge)
    result, calls = patched_update(worker, mode=mode)
    assert result == {"verl": True} and calls == [mode]
    assert worker.checkpoint_engine.sent == [] and worker.actor.engine.calls == []


# --- verl 0.9.1's behaviour the patch replaces, pinned -----------------------------------------------------------


def test_verls_checkpoint_engine_path_sends_default_parameters_and_no_peft_config():
    """verl 0.9.1: the non-naive branch of ``ActorRolloutRefWorker.update_weights`` sends
    ``get_per_tensor_param()`` with its defaults (the base, for LoRA), and ``CheckpointEngineWorker.update_weights``
    passes the server adapter no ``peft_config``. verl PR #7496 changes both: then the patch is to go."""
    from areal_plugins.patches import lora_separate_sync
    from verl.checkpoint_engine.base import CheckpointEngineWorker
    from verl.workers.engine_workers import ActorRolloutRefWorker

    method = ActorRolloutRefWorker.update_weights
    if lora_separate_sync.is_applied():
        method = lora_separate_sync.PATCH.original(
            "verl.workers.engine_workers", "ActorRolloutRefWorker.update_weights"
        )
    source = inspect.getsource(method)
    non_naive = source[source.index('if effective_mode != "naive"') : source.index("set_expandable_segments(False)")]
    assert "per_tensor_param, _ = self.actor.engine.get_per_tensor_param()" in non_naive
    assert "peft_config" not in inspect.getsource(CheckpointEngineWorker.update_weights)
    assert list(inspect.signature(method).parameters) == ["self", "global_steps", "mode"]
