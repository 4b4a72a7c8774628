"""The ``areal_gloo`` checkpoint engine class (the protocol is described in :mod:`.gloo`).

This module imports verl's checkpoint-engine base at its top, so nothing imports it but
:func:`areal_plugins.weight_sync.gloo.register_gloo_checkpoint_engine`, which verl runs once its registry is
imported: loading the plugin stays light. The wire format (``_pack``, ``_unpack``, ``buckets``) and the
timeout stay in :mod:`.gloo`, which hands its module to the class on registration (:attr:`wire`): this module does
not import its registrar, and a test that replaces a wire function there is seen here.
"""

from __future__ import annotations

import logging
import pickle
import types
from collections import deque
from collections.abc import Generator, Iterator
from datetime import timedelta
from typing import Any, ClassVar

import torch
from verl.checkpoint_engine.base import CheckpointEngine

from areal_plugins.weight_sync.checksums import same_checksum, tensor_checksum
from areal_plugins.weight_sync.errors import WeightSyncError

logger = logging.getLogger("areal_plugins.weight_sync.gloo")


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
    #: weight_sync/gloo.py (``_pack``, ``_unpack``, ``buckets``, ``TIMEOUT_S``), set by its registration and read at
    #: call time.
    wire: ClassVar[types.ModuleType]

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

        timeout = timedelta(seconds=self.wire.TIMEOUT_S)
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
        for bucket in self.wire.buckets(weights, self.bucket_size):  # one bucket of lookahead: the last one says so
            if pending is not None:
                sent += self._send_bucket(pending, is_last=False)
                count += 1
            pending = bucket
        sent += self._send_bucket(pending or [], is_last=True)
        logger.info("areal_gloo: sent %d bytes in %d buckets (version %s)", sent, count + 1, global_steps)

    def _send_bucket(self, bucket: list[tuple[str, torch.Tensor]], is_last: bool) -> int:
        entries, payload = self.wire._pack(bucket)
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
                    self.wire._unpack(header["entries"], payload), header["checksums"], strict=True
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
