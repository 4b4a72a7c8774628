"""Tensors larger than verl's transfer bucket, cut into flat ranges on the sender and joined on the vLLM worker.

verl's vLLM server adapter moves weights to its engine's workers with its bucketed sender
(``verl/workers/rollout/vllm_rollout/bucketed_weight_transfer.py``): tensors are packed into one buffer of
``actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes`` (CUDA IPC on a GPU, shared memory
where the device has no IPC) and a tensor larger than that buffer takes a direct path instead: a handle from
torch's ``reduce_tensor``, which the receiver rebuilds as a CUDA IPC handle on its own device. That holds only for
a tensor on a CUDA device. What ``areal_gloo`` delivers to the adapter lies on the host, so on a GPU the receiver
fails to rebuild it while the sender waits for its answer forever; with shared memory (CPU, an NPU without IPC) the
sender asserts ("too large to fit in the bucket"). A 7B model's float32 ``embed_tokens`` (2,079 MiB) is larger than
the 2,048 MiB that the GPU recipes set.

:func:`cut_large` (the adapter, on the sender's side) hands such a tensor to verl's sender as consecutive pieces of
its flattened elements, each at most a bucket and named so that no parameter can have the name
(:data:`PART_MARK`); :class:`Joiner` (the worker extension, on the receiving side) copies the pieces into one tensor
of the original shape on the receiving device and passes that on in the pieces' place, once the last piece arrived.
The checksums of the update stay those of whole tensors: the adapter takes its "sent" checksum before cutting, the
worker its "received" one after joining. Pure torch: imported by both processes.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import torch

from areal_plugins.weight_sync.errors import WeightSyncError

#: ``actor_rollout_ref.rollout.custom.<this>: true``: this run's vLLM workers run our extension, which joins pieces;
#: set by our trainers before verl builds its workers (rollout/verl_vllm/server.py), read by the adapter on every rank.
JOINS_PIECES_KEY = "areal_joins_pieces"
#: Start of a piece's name: ``areal.part|<first element>|<elements of the whole>|<shape>|<tensor name>``.
PART_MARK = "areal.part"


@dataclass(frozen=True)
class Piece:
    """Where one piece belongs: the whole tensor's name and shape, and the piece's first element in it."""

    name: str
    shape: tuple[int, ...]
    start: int

    @property
    def total(self) -> int:
        """Elements of the whole tensor."""
        count = 1
        for size in self.shape:
            count *= size
        return count

    def encode(self) -> str:
        shape = "x".join(str(size) for size in self.shape)
        return f"{PART_MARK}|{self.start}|{shape}|{self.name}"

    @classmethod
    def decode(cls, name: str) -> Piece | None:
        """The piece a transferred name stands for; None for an ordinary tensor's name."""
        if not name.startswith(PART_MARK + "|"):
            return None
        _, start, shape, whole = name.split("|", 3)
        return cls(whole, tuple(int(size) for size in shape.split("x")) if shape else (), int(start))


def pieces(name: str, tensor: torch.Tensor, bucket_bytes: int) -> list[tuple[str, torch.Tensor]]:
    """``tensor`` as consecutive views of its flattened elements, each at most ``bucket_bytes`` bytes."""
    per_piece = bucket_bytes // tensor.element_size()
    if per_piece < 1:
        raise ValueError(
            f"a transfer bucket of {bucket_bytes} bytes cannot hold one {tensor.dtype} element of {name}: raise "
            "actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes"
        )
    flat = tensor.detach().contiguous().view(-1)
    shape = tuple(tensor.shape)
    return [
        (Piece(name, shape, start).encode(), flat[start : start + per_piece])
        for start in range(0, flat.numel(), per_piece)
    ]


async def cut_large(
    weights: AsyncIterator[tuple[str, torch.Tensor]], bucket_bytes: int, must_cut: Callable[[torch.Tensor], bool]
) -> AsyncIterator[tuple[str, torch.Tensor]]:
    """``weights`` with every tensor larger than ``bucket_bytes`` for which ``must_cut`` holds given as pieces
    (:func:`pieces`), the others as they are. The pieces are views: nothing is copied here."""
    async for name, tensor in weights:
        if tensor.numel() * tensor.element_size() > bucket_bytes and must_cut(tensor):
            for piece in pieces(name, tensor, bucket_bytes):
                yield piece
        else:
            yield name, tensor


class Joiner:
    """The receiving side of :func:`cut_large`: one bucket at a time, pieces in, whole tensors out.

    A tensor's pieces arrive one after another, in order (verl's sender keeps the order of what it is given), so
    at most one tensor is being joined: the memory held beside the bucket is that one tensor, on the device the
    pieces arrive on.
    """

    def __init__(self) -> None:
        self._piece: Piece | None = None
        self._whole: torch.Tensor | None = None
        self._filled = 0
        #: Names of the tensors joined so far, in their order of arrival.
        self.joined: list[str] = []

    def take(self, bucket: list[tuple[str, torch.Tensor]], copy_others: bool = False) -> list[tuple[str, torch.Tensor]]:
        """The bucket's tensors with its pieces replaced by the whole tensors they completed (a tensor whose last
        piece has not arrived yet comes in a later bucket). A piece is copied out of the bucket at once: the
        transport reuses the bucket's memory for the next one. ``copy_others``: the other tensors too (a caller
        that keeps them past the bucket); a joined tensor is a copy already."""
        out: list[tuple[str, torch.Tensor]] = []
        for name, tensor in bucket:
            piece = Piece.decode(name)
            if piece is None:
                self._require_none_open(f"tensor {name} arrived")
                out.append((name, tensor.clone() if copy_others else tensor))
                continue
            whole = self._open(piece, tensor)
            count = tensor.numel()
            if piece.start + count > piece.total:
                raise WeightSyncError(
                    f"tensor {piece.name}: a piece of {count} elements from element {piece.start} does not fit its "
                    f"{piece.total} elements: the weight transfer delivered pieces that do not belong together"
                )
            whole[piece.start : piece.start + count].copy_(tensor.reshape(-1))
            self._filled += count
            if self._filled == piece.total:
                out.append((piece.name, whole.view(piece.shape)))
                self.joined.append(piece.name)
                self._piece, self._whole, self._filled = None, None, 0
        return out

    def finish(self) -> None:
        """The update ended: raise if a tensor's pieces stopped before its last one."""
        self._require_none_open("the update ended")

    def _open(self, piece: Piece, tensor: torch.Tensor) -> torch.Tensor:
        if piece.start == 0:
            self._require_none_open(f"tensor {piece.name} began")
            self._piece, self._filled = piece, 0
            self._whole = torch.empty(piece.total, dtype=tensor.dtype, device=tensor.device)
            return self._whole
        if (
            self._piece is None
            or self._whole is None
            or (piece.name, piece.shape) != (self._piece.name, self._piece.shape)
        ):
            raise WeightSyncError(
                f"tensor {piece.name}: a piece from element {piece.start} arrived without the pieces before it: the "
                "weight transfer lost or reordered a part of it"
            )
        if piece.start != self._filled:
            raise WeightSyncError(
                f"tensor {piece.name}: the piece from element {piece.start} arrived after {self._filled} elements: "
                "the weight transfer lost or reordered a part of it"
            )
        return self._whole

    def _require_none_open(self, event: str) -> None:
        if self._piece is not None:
            raise WeightSyncError(
                f"tensor {self._piece.name}: {event} after {self._filled} of its {self._piece.total} elements: the "
                "weight transfer lost the rest of it; the engine does not load a partial tensor"
            )
