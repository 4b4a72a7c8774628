"""A LoRA update as one stream of named tensors, for checkpoint engines that carry nothing but tensors.

verl 0.9.1's colocated sync hands a LoRA update to the server adapter as two calls with ``peft_config`` and
``base_sync_done`` beside the tensors (base weights once, then the adapter). Its checkpoint-engine path (``placement:
separate``) has no such arguments: ``CheckpointEngineWorker.update_weights`` passes the received tensors alone, and
verl's trainer sends the base weights there, never the adapter (verl issue #7495). Under ``areal.enable`` the trainer
sends instead (patches/lora_separate_sync.py) one stream:

1. :data:`HEADER`: a ``uint8`` tensor holding ``{"peft_config": ..., "base": bool}`` pickled (peft's config dict
   holds sets; the colocated path hands it over pickled too, by Ray);
2. if ``base``: the base weights under peft's ``.base_layer`` names, then :data:`ADAPTER_FOLLOWS` (16 bytes);
3. the adapter's tensors.

The markers are tensors, so every transport carries them and checks them as any other (areal_gloo's in-band
checksums, the nccl mixin's); the rollout side's server adapter (:func:`read_lora_update`) takes them out and makes
verl's two colocated calls, so the engines load and check the adapter exactly as in the colocated placement.
"""

from __future__ import annotations

import pickle
from collections.abc import AsyncIterator, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from areal_plugins.weight_sync.errors import WeightSyncError

HEADER = "areal.lora_update.header"
ADAPTER_FOLLOWS = "areal.lora_update.adapter_follows"
#: Set on a trainer worker's checkpoint engine (``execute_checkpoint_engine("__setattr__", ...)``: weight_sync/
#: staged.py) to send the base weights again on the next update: a replacement replica started from dummy weights.
RESEND_BASE_ATTRIBUTE = "areal_resend_lora_base"


#: The markers' sizes are padded to a multiple of this: verl's bucketed transports (nccl, the vLLM IPC sender) pack
#: tensors back to back and the receiver views each slice as its dtype, which needs the slice aligned to its element
#: size; 16 bytes keep every tensor after a marker as aligned as it would be without it.
ALIGN = 16


def _bytes_tensor(value: dict[str, Any]) -> torch.Tensor:
    raw = pickle.dumps(value)  # pickle.loads stops at the pickle's end: the padding is never read
    return torch.frombuffer(bytearray(raw + bytes(-len(raw) % ALIGN)), dtype=torch.uint8).clone()


def lora_update_stream(
    base: Iterable[tuple[str, torch.Tensor]] | None,
    adapter: Iterable[tuple[str, torch.Tensor]],
    peft_config: dict[str, Any],
) -> Iterator[tuple[str, torch.Tensor]]:
    """The trainer's side: ``base`` (None: the engines hold it already) and ``adapter`` as one stream."""
    yield HEADER, _bytes_tensor({"peft_config": peft_config, "base": base is not None})
    if base is not None:
        yield from base
        yield ADAPTER_FOLLOWS, torch.ones(ALIGN, dtype=torch.uint8)
    yield from adapter


@dataclass
class LoraUpdate:
    """The rollout side's view of a received stream: ``peft_config`` None where it is not a LoRA update (then
    :meth:`rest` is the whole stream, unchanged)."""

    peft_config: dict[str, Any] | None
    has_base: bool
    _first: tuple[str, torch.Tensor] | None
    _source: AsyncIterator[tuple[str, torch.Tensor]]

    async def rest(self) -> AsyncIterator[tuple[str, torch.Tensor]]:
        """A non-LoRA stream, whole (its first tensor put back)."""
        if self._first is not None:
            yield self._first
        async for item in self._source:
            yield item

    async def base(self) -> AsyncIterator[tuple[str, torch.Tensor]]:
        """The base weights, up to the marker: drain it before :meth:`adapter`."""
        async for name, tensor in self._source:
            if name == ADAPTER_FOLLOWS:
                return
            yield name, tensor
        raise WeightSyncError(f"the LoRA update ended inside its base weights: no {ADAPTER_FOLLOWS} marker came")

    async def adapter(self) -> AsyncIterator[tuple[str, torch.Tensor]]:
        """The adapter's tensors, the rest of the stream."""
        async for name, tensor in self._source:
            if name in (HEADER, ADAPTER_FOLLOWS):
                raise WeightSyncError(f"the LoRA update holds {name} among its adapter tensors")
            yield name, tensor


async def read_lora_update(weights: Any) -> LoraUpdate:
    """Read the first tensor of ``weights`` (a sync or async iterable of ``(name, tensor)``): a :data:`HEADER`
    makes it a LoRA update."""
    from verl.workers.rollout.utils import ensure_async_iterator

    source = aiter(ensure_async_iterator(weights))
    first = await anext(source, None)
    if first is None or first[0] != HEADER:
        return LoraUpdate(None, False, first, source)
    header = pickle.loads(first[1].to("cpu").contiguous().view(torch.uint8).numpy().tobytes())
    return LoraUpdate(dict(header["peft_config"]), bool(header["base"]), None, source)


async def load_lora_update(weights: Any, kwargs: dict[str, Any], load: Any) -> tuple[bool, Any]:
    """A server adapter's ``update_weights`` for a stream that may hold a LoRA update: if it does, ``load`` (the
    adapter's own update call, taking the tensors and keyword arguments) runs as verl's colocated sync calls it, the
    base weights with ``base_sync_done=False`` (when they came) then the adapter with ``True``, and this returns
    ``(True, the adapter load's result)``; otherwise ``(False, the stream, whole)`` for the caller to load."""
    if kwargs.get("peft_config") is not None:  # verl's colocated call: already split
        return False, weights
    update = await read_lora_update(weights)
    if update.peft_config is None:
        return False, update.rest()
    lora = {**kwargs, "peft_config": update.peft_config}
    if update.has_base:
        await load(update.base(), **lora, base_sync_done=False)
    return True, await load(update.adapter(), **lora, base_sync_done=True)
