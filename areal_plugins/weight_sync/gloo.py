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

import logging
import pickle
from collections import deque
from collections.abc import Generator, Iterator
from datetime import timedelta
from typing import Any

import torch

from areal_plugins.weight_sync.checksums import same_checksum, tensor_checksum
from areal_plugins.weight_sync.errors import WeightSyncError

logger = logging.getLogger(__name__)

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
    from verl.checkpoint_engine.base import CheckpointEngine, CheckpointEngineRegistry

    @CheckpointEngineRegistry.register(BACKEND_NAME)
    class GlooCheckpointEngine(CheckpointEngine):
        """Weights from the trainer's rank 0 to every standalone rollout worker, over a gloo group of its own.

        Args:
            bucket_size: bytes per broadcast (verl's ``update_weights_bucket_megabytes``).
            is_master: True on the trainer's rank 0, which hosts the group's store.
        """

        #: A rollout worker can receive a whole update before its engine loads it (:meth:`stage`), so the
        #: engines keep generating during the broadcast (weight_sync/staged.py).
        stages_weights = True
        #: Its in-band checksums are also kept for the manager's check of the leg (weight_sync/checked_transfer.py).
        reports_transfer_checksums = True

        def __init__(self, bucket_size: int, is_master: bool = False, **kwargs: Any) -> None:
            self.bucket_size = int(bucket_size)
            self.is_master = is_master
            self.rank = -1
            self.group: Any = None
            self._store: Any = None
            self._staged: deque[tuple[str, torch.Tensor]] | None = None
            self.areal_sent: dict[str, list[float]] = {}
            self.areal_received: dict[str, list[float]] = {}

        def prepare(self) -> dict[str, Any]:
            if not self.is_master:
                return {}
            import ray
            from verl.utils.net_utils import get_free_port

            from areal_plugins.platforms.ports import free_port_outside_ephemeral_range

            host = ray.util.get_node_ip_address().strip("[]")
            port = free_port_outside_ephemeral_range()  # the group is built anew at every update: platforms/ports.py
            if port is None:  # the node's ephemeral range starts too low: take verl's choice
                port, sock = get_free_port(host)
                if sock is not None:
                    sock.close()
            return {"host": host, "port": port}

        @classmethod
        def build_topology(
            cls, actor_wg_world_size: int, rollout_world_size: int, metadata: list[dict]
        ) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
            master = metadata[0]
            if "host" not in master:
                raise RuntimeError("areal_gloo: the trainer's rank 0 did not announce the group's address")
            world_size = 1 + rollout_world_size  # one sender, every rollout worker
            actor: dict[str, list[Any]] = {
                "rank": [0] + [-1] * (actor_wg_world_size - 1),
                "world_size": [world_size] * actor_wg_world_size,
                "master": [master] * actor_wg_world_size,
            }
            rollout: dict[str, list[Any]] = {
                "rank": list(range(1, world_size)),
                "world_size": [world_size] * rollout_world_size,
                "master": [master] * rollout_world_size,
            }
            return actor, rollout

        def init_process_group(  # type: ignore[override]  # verl passes build_topology's keys as kwargs
            self, rank: int, world_size: int, master: dict[str, Any]
        ) -> None:
            self.rank = rank
            if rank < 0:
                return
            import torch.distributed as dist

            timeout = timedelta(seconds=TIMEOUT_S)
            self._store = dist.TCPStore(
                master["host"], master["port"], world_size, is_master=rank == 0, timeout=timeout, wait_for_workers=True
            )
            self.group = dist.ProcessGroupGloo(self._store, rank, world_size, timeout)

        def areal_transfer_checksums(self) -> dict[str, Any]:
            from areal_plugins.weight_sync.checked_transfer import transfer_report

            return transfer_report(self)

        def finalize(self) -> None:
            self._staged = None
            self.group = None
            self._store = None
            self.rank = -1

        def _broadcast(self, tensor: torch.Tensor) -> None:
            self.group.broadcast(tensor, 0).wait()

        def _broadcast_object(self, value: Any) -> Any:
            data = torch.frombuffer(bytearray(pickle.dumps(value)), dtype=torch.uint8) if self.rank == 0 else None
            length = torch.tensor([0 if data is None else data.numel()], dtype=torch.int64)
            self._broadcast(length)
            buffer = data if data is not None else torch.empty(int(length.item()), dtype=torch.uint8)
            self._broadcast(buffer)
            return pickle.loads(buffer.numpy().tobytes())

        @torch.no_grad()
        async def send_weights(self, weights: Generator[tuple[str, torch.Tensor], None, None], global_steps=None):
            if self.rank < 0:  # producing full tensors is collective over the trainer's ranks: walk them all
                for _ in weights:
                    pass
                return
            if self.rank != 0:
                raise RuntimeError(f"areal_gloo: trainer rank {self.rank} cannot send; only rank 0 sends")
            self.areal_sent = {}
            self.areal_rank = self.rank
            sent, count, pending = 0, 0, None
            for bucket in buckets(weights, self.bucket_size):  # one bucket of lookahead: the last one says so
                if pending is not None:
                    sent += self._send_bucket(pending, is_last=False)
                    count += 1
                pending = bucket
            sent += self._send_bucket(pending or [], is_last=True)
            logger.info("areal_gloo: sent %d bytes in %d buckets (version %s)", sent, count + 1, global_steps)

        def _send_bucket(self, bucket: list[tuple[str, torch.Tensor]], is_last: bool) -> int:
            entries, payload = _pack(bucket)
            checksums = [tensor_checksum(tensor) for _, tensor in bucket]  # of what leaves the trainer
            self.areal_sent.update((name, checksum) for (name, _), checksum in zip(bucket, checksums, strict=True))
            self._broadcast_object({"entries": entries, "checksums": checksums, "is_last": is_last})
            self._broadcast(payload)
            return payload.numel()

        @torch.no_grad()
        def stage(self, global_steps=None) -> int:
            """Receive the whole update now, each tensor checked, and keep it for the next :meth:`receive_weights`
            (host memory: one copy of the model). Returns the bytes kept."""
            self._staged = None  # a stage left by a failed update goes before the next one arrives
            staged = deque(self._receive(global_steps))
            self._staged = staged
            return sum(tensor.numel() * tensor.element_size() for _, tensor in staged)

        def receive_weights(  # type: ignore[override]  # a plain generator: the adapter takes both kinds
            self, global_steps=None
        ) -> Iterator[tuple[str, torch.Tensor]]:
            """The staged update if there is one (handed over once), else the broadcast as it arrives."""
            if self._staged is not None:
                staged, self._staged = self._staged, None
                while staged:  # each tensor goes once the adapter has passed it on
                    yield staged.popleft()
                return
            yield from self._receive(global_steps)

        def _next_bucket(self) -> tuple[dict[str, Any], torch.Tensor]:
            header = self._broadcast_object(None)
            payload = torch.empty(sum(entry[4] for entry in header["entries"]), dtype=torch.uint8)
            self._broadcast(payload)
            return header, payload

        def _drain(self, update: str) -> None:
            """Take the rest of the update without keeping it: every broadcast waits for every rank, so a worker
            that stops part-way would hold the sender and the other workers until the group's timeout. A failure
            here (the sender went too) is logged: the caller's own error is what this worker reports."""
            try:
                while not self._next_bucket()[0]["is_last"]:
                    pass
            except Exception:
                logger.warning("areal_gloo: taking the rest of %s failed", update, exc_info=True)

        @torch.no_grad()
        def _receive(self, global_steps=None) -> Iterator[tuple[str, torch.Tensor]]:
            if self.rank < 1:
                raise RuntimeError("areal_gloo: only rollout workers (ranks >= 1) receive weights")
            self.areal_received = {}
            self.areal_rank = self.rank
            failure: WeightSyncError | None = None
            is_last = False
            try:
                while not is_last and failure is None:
                    header, payload = self._next_bucket()
                    is_last = header["is_last"]
                    for (name, tensor), sent in zip(
                        _unpack(header["entries"], payload), header["checksums"], strict=True
                    ):
                        received = tensor_checksum(tensor)
                        self.areal_received[name] = received
                        tensor.areal_checksum = received  # type: ignore[attr-defined]  # the adapter's "sent"
                        if not same_checksum(sent, received):
                            failure = WeightSyncError(
                                f"areal_gloo broadcast, rollout worker rank {self.rank}: tensor {name} arrived "
                                "different from what trainer rank 0 sent ([elements, sum, sum of squares, "
                                f"position-weighted sum] sent {sent}, received {received}); stopping before the "
                                "engine loads it"
                            )
                            break
                        yield name, tensor
            except GeneratorExit:  # the consumer stopped part-way (its own check failed): the others go on
                if not is_last:
                    self._drain("an abandoned update")
                raise
            if failure is not None:
                if not is_last:
                    self._drain("a failed update")
                raise failure

    return GlooCheckpointEngine


def register_gloo_checkpoint_engine() -> None:
    """Register ``areal_gloo`` in verl's ``CheckpointEngineRegistry`` (idempotent)."""
    from verl.checkpoint_engine.base import CheckpointEngineRegistry

    if BACKEND_NAME not in CheckpointEngineRegistry._registry:
        _make_engine_class()
