"""``areal_gloo``: verl checkpoint engine that broadcasts the trainer's weights to standalone rollout workers over gloo.

verl moves weights from the trainer to a rollout pool of its own through a checkpoint engine
registered in ``CheckpointEngineRegistry`` (``actor_rollout_ref.rollout.checkpoint_engine.backend``).
Its engines (nccl, nixl, mooncake, ...) need GPUs; this one needs nothing but TCP, so the very same
trainer code path — standalone rollout pool, ``CheckpointEngineManager.update_weights`` — runs on CPU
machines and in CI. On GPUs name ``nccl`` instead: nothing else changes.

Protocol, per update: the trainer's rank 0 (the only sender; the other trainer ranks walk the weight
generator, which is collective over the trainer's ranks, and leave) packs tensors into buckets of
``bucket_size`` bytes and broadcasts, for each bucket, a header (names, shapes, dtypes, offsets, and
whether it is the last bucket) and then the bucket's bytes, on a gloo group of its own (a TCP store on
rank 0's node, not the workers' default process group). The header also carries the sender's checksum of
each tensor (:mod:`.checksums`); every rollout worker rebuilds the tensors, compares each with the sender's
checksum (so a tensor changed on the broadcast leg stops the update, naming the worker and the tensor; that
worker still takes the rest of the broadcast, so the sender and the other workers finish instead of waiting out
the group's timeout) and
hands them to its server adapter, which checks the next leg, to the engine. Under ``areal_async`` the workers
receive the whole update first (:meth:`stage`) while the engines generate, and hand it over when they are paused
(weight_sync/staged.py).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator

import torch

from areal_plugins.weight_sync.errors import WeightSyncError

__all__ = ["BACKEND_NAME", "TIMEOUT_S", "WeightSyncError", "buckets", "register_gloo_checkpoint_engine"]

BACKEND_NAME = "areal_gloo"
#: Seconds a broadcast may wait for its peers before the update fails (a dead worker, a wrong address).
TIMEOUT_S = 600.0


def _pack(tensors: list[tuple[str, torch.Tensor]]) -> tuple[list[tuple[str, list[int], str, int, int]], torch.Tensor]:
    """One bucket: ``(name, shape, dtype, offset, nbytes)`` per tensor and their bytes back to back."""
    entries, parts, offset = [], [], 0
    for name, tensor in tensors:
        raw = tensor.detach().to("cpu").contiguous().view(-1).view(torch.uint8)
        entries.append((name, list(tensor.shape), str(tensor.dtype).removeprefix("torch."), offset, raw.numel()))
        parts.append(raw)
        offset += raw.numel()
    return entries, torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)


def _unpack(
    entries: list[tuple[str, list[int], str, int, int]], payload: torch.Tensor
) -> Iterator[tuple[str, torch.Tensor]]:
    for name, shape, dtype, offset, nbytes in entries:
        raw = payload[offset : offset + nbytes].clone()
        yield name, raw.view(getattr(torch, dtype)).view(shape)


def buckets(weights: Iterator[tuple[str, torch.Tensor]], bucket_size: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group ``weights`` into lists of at most ``bucket_size`` bytes (a larger tensor gets a bucket alone)."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in weights:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_size:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    yield bucket  # the last one, possibly empty: it carries is_last


def _make_engine_class() -> type:
    """The engine class (weight_sync/gloo_engine.py), registered; verl's base is imported only here."""
    from verl.checkpoint_engine.base import CheckpointEngineRegistry

    from areal_plugins.weight_sync.gloo_engine import GlooCheckpointEngine

    GlooCheckpointEngine.wire = sys.modules[__name__]
    return CheckpointEngineRegistry.register(BACKEND_NAME)(GlooCheckpointEngine)


def register_gloo_checkpoint_engine() -> None:
    """Register ``areal_gloo`` in verl's ``CheckpointEngineRegistry`` (idempotent)."""
    from verl.checkpoint_engine.base import CheckpointEngineRegistry

    if BACKEND_NAME not in CheckpointEngineRegistry._registry:
        _make_engine_class()
