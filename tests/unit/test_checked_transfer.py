"""The checksum mixin of verl's transport engines (weight_sync/checked_transfer.py), over a stand-in transport:
verl's ``nccl`` needs cupy and GPUs. The stand-in hands the receiver what the sender gave it, through a queue, and
can change one value on the way, as a bad link would."""

from __future__ import annotations

import asyncio
from typing import ClassVar

import pytest
import torch
from verl.checkpoint_engine.base import CheckpointEngineRegistry

from areal_plugins.weight_sync.checked_transfer import (
    ChecksumsOfTransfer,
    check_transfer_reports,
    checked,
    register_checked_checkpoint_engines,
)
from areal_plugins.weight_sync.checksums import tensor_checksum
from areal_plugins.weight_sync.errors import WeightSyncError


class LinkTransport:
    """verl's engine interface as the manager drives it: rank 0 sends, every other rank receives (async)."""

    link: ClassVar[list[tuple[str, torch.Tensor]]] = []
    flip: str = ""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    async def send_weights(self, weights, global_steps=None):
        for name, tensor in weights:  # the transport copies each tensor into its buffer
            LinkTransport.link.append((name, tensor.clone()))

    async def receive_weights(self, global_steps=None):
        for name, tensor in LinkTransport.link:
            delivered = tensor.clone()
            if name == self.flip:
                delivered.view(-1)[1] = -delivered.view(-1)[1]
            yield name, delivered


def transfer(flip_on: dict[int, str]) -> tuple[list[dict], list[dict], dict[int, dict[str, torch.Tensor]]]:
    LinkTransport.link = []
    engine_cls = checked(LinkTransport)
    generator = torch.Generator().manual_seed(1)
    weights = {"embed": torch.randn(8, 4, generator=generator), "norm": torch.rand(4, generator=generator) + 0.5}
    trainer = [engine_cls(rank) for rank in (0, -1)]
    for engine in trainer:
        asyncio.run(engine.send_weights(iter(weights.items())))
    rollout = [engine_cls(rank) for rank in (1, 2)]
    delivered = {}
    for engine in rollout:
        engine.flip = flip_on.get(engine.rank, "")

        async def drain(engine=engine) -> dict[str, torch.Tensor]:
            return {name: tensor async for name, tensor in engine.receive_weights()}

        delivered[engine.rank] = asyncio.run(drain())
    reports = lambda engines: [engine.areal_transfer_checksums() for engine in engines]  # noqa: E731
    return reports(trainer), reports(rollout), delivered


def test_an_intact_transfer_passes_and_hands_on_every_tensor_unchanged():
    trainer, rollout, delivered = transfer({})
    assert check_transfer_reports(trainer, rollout, "nccl") == 2
    assert trainer[1]["sent"] == {}  # only the source rank checksums what it sends
    assert set(delivered[1]) == {"embed", "norm"}
    # each delivered tensor carries its (pending) checksum, so the server adapter does not take it again
    for name, tensor in delivered[2].items():
        carried = tensor.areal_pending_checksums.resolve()[name]
        assert carried == rollout[1]["received"][name] == tensor_checksum(tensor)


def test_the_report_keeps_the_rank_verls_finalize_resets():
    engine = checked(LinkTransport)(2)
    LinkTransport.link = [("norm", torch.ones(3))]

    async def drain() -> None:
        async for _ in engine.receive_weights():
            pass

    asyncio.run(drain())
    engine.rank = None  # verl's nccl finalize with rebuild_group
    assert engine.areal_transfer_checksums()["rank"] == 2


def test_a_sign_flipped_on_one_workers_link_is_named():
    trainer, rollout, _ = transfer({2: "norm"})
    with pytest.raises(WeightSyncError, match=r"nccl transfer from trainer rank 0, rollout worker rank 2: tensor norm"):
        check_transfer_reports(trainer, rollout, "nccl")


def test_a_transfer_without_the_senders_checksums_is_refused_not_passed():
    trainer, rollout, _ = transfer({})
    trainer[0]["sent"] = {}
    with pytest.raises(WeightSyncError, match=r"expected one sending trainer rank .* found 0"):
        check_transfer_reports(trainer, rollout, "nccl")


def test_verls_engine_is_registered_again_under_its_name_with_the_mixin(monkeypatch):
    monkeypatch.setattr(CheckpointEngineRegistry, "_registry", {"nccl": LinkTransport, "naive": object})
    register_checked_checkpoint_engines()
    register_checked_checkpoint_engines()  # idempotent: mixed in once
    engine_cls = CheckpointEngineRegistry._registry["nccl"]
    assert engine_cls.__mro__[1:3] == (ChecksumsOfTransfer, LinkTransport)
    assert CheckpointEngineRegistry._registry["naive"] is object
