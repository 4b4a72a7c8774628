"""The checkpoint engine's leg, checked: what the trainer sent against what each rollout worker received.

Under ``placement: separate`` weights travel trainer -> checkpoint engine (``nccl`` between GPU nodes) -> each rollout
worker's checkpoint-engine process -> the engine. Our server adapter checks the last leg and the load; this module
checks the first. :class:`ChecksumsOfTransfer` is mixed into verl's ``nccl`` engine (registered under the same
name in every process, :func:`register_checked_checkpoint_engines`): the trainer's sending rank checksums every
tensor as it hands it to the transport, each rollout worker every tensor the transport delivered, on the device
that holds it. After each update the manager (weight_sync/staged.py) compares them, worker by worker
(:func:`check_transfer_reports`), and a difference stops the run naming the worker and the tensor.
``areal_gloo`` records the same numbers from its own in-band check.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

from areal_plugins.weight_sync.checksums import PendingChecksums, check_weight_reports
from areal_plugins.weight_sync.errors import WeightSyncError

logger = logging.getLogger(__name__)

#: verl's checkpoint engines that get the mixin: they deliver named tensors to the adapter.
CHECKED_BACKENDS = ("nccl",)


class ChecksumsOfTransfer:
    """Mixin over a verl ``CheckpointEngine`` (first base after it): per-tensor checksums of what the sending rank
    (rank 0 of the transfer group) sent and of what this rollout worker received."""

    rank: int
    #: The manager asks engines of this kind for :meth:`areal_transfer_checksums` after each update.
    reports_transfer_checksums = True

    async def send_weights(self, weights: Any, global_steps: Any = None) -> Any:
        self.areal_sent: dict[str, list[float]] = {}
        self.areal_rank = getattr(self, "rank", -1)  # verl's finalize may reset it before the manager asks
        pending = PendingChecksums()  # one host copy per update, not one per tensor

        def checksummed() -> Any:
            for name, tensor in weights:
                if self.areal_rank == 0:  # the source; relays and idle ranks only walk the generator
                    pending.add(name, tensor)
                yield name, tensor

        result = await super().send_weights(checksummed(), global_steps)  # type: ignore[misc]
        self.areal_sent.update(pending.resolve())
        return result

    async def receive_weights(self, global_steps: Any = None) -> AsyncIterator[Any]:
        from verl.workers.rollout.utils import ensure_async_iterator

        self.areal_received: dict[str, list[float]] = {}
        self.areal_rank = getattr(self, "rank", -1)
        pending = PendingChecksums()
        async for name, tensor in ensure_async_iterator(super().receive_weights(global_steps)):  # type: ignore[misc]
            pending.add(name, tensor)  # queued before the transport reuses its buffer (PendingChecksums)
            tensor.areal_pending_checksums = pending  # the server adapter's checksum of what it passes on: not twice
            yield name, tensor
        self.areal_received.update(pending.resolve())

    def areal_transfer_checksums(self) -> dict[str, Any]:
        return transfer_report(self)


def transfer_report(engine: Any) -> dict[str, Any]:
    """What one process of the transfer group sent (rank 0) or received (rollout workers) in the last update."""
    rank = getattr(engine, "areal_rank", None)
    rank = getattr(engine, "rank", None) if rank is None else rank
    return {
        "rank": -1 if rank is None else int(rank),
        "sent": dict(getattr(engine, "areal_sent", {}) or {}),
        "received": dict(getattr(engine, "areal_received", {}) or {}),
    }


def check_transfer_reports(trainer: list[dict[str, Any]], rollout: list[dict[str, Any]], backend: str) -> int:
    """Raise :class:`WeightSyncError` naming the rollout worker and the tensor where what it received differs from
    what the trainer's sending rank sent; a report's ``name`` (its replica and worker, set by the manager) goes in
    the message. Returns the tensors compared per worker."""
    senders = [report for report in trainer if report["rank"] == 0 and report["sent"]]
    if len(senders) != 1:
        raise WeightSyncError(
            f"{backend} transfer: expected one sending trainer rank with checksums of what it sent, found "
            f"{len(senders)}: the transfer cannot be checked"
        )
    sent = senders[0]["sent"]
    as_received = [
        {"rank": report["rank"], "checksums": report["received"], "name": report.get("name")} for report in rollout
    ]
    check_weight_reports(as_received, sent, f"{backend} transfer from trainer rank 0", worker_kind="rollout worker")
    return len(sent)


def checked(engine_cls: type) -> type:
    """``engine_cls`` with :class:`ChecksumsOfTransfer` mixed in, under the same name."""
    return type(engine_cls.__name__, (ChecksumsOfTransfer, engine_cls), {"__doc__": engine_cls.__doc__})


def register_checked_checkpoint_engines() -> None:
    """Re-register verl's engines of :data:`CHECKED_BACKENDS` with the mixin, where their transport imports (cupy
    for ``nccl``: GPU machines). Idempotent; a no-op where verl could not import them."""
    from verl.checkpoint_engine.base import CheckpointEngineRegistry

    for backend in CHECKED_BACKENDS:
        engine_cls = CheckpointEngineRegistry._registry.get(backend)
        if engine_cls is not None and not issubclass(engine_cls, ChecksumsOfTransfer):
            CheckpointEngineRegistry.register(backend)(checked(engine_cls))
