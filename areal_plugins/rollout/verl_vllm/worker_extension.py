"""The vLLM worker extension of verl's ``vllm`` rollout under ``areal_async``.

verl's extension (``vLLMColocateWorkerExtension``) receives the trainer's weights in buckets (CUDA IPC on a GPU,
shared memory elsewhere) and loads each bucket with the model's ``load_weights``. Ours adds:

* a checksum per received tensor, ``[elements, Σx, Σx²]`` in float64, computed where the tensor lies (on a GPU,
  a reduction kernel on the device; one small host copy of three numbers per tensor), after the transport and
  before loading. The trainer compares it with the same numbers computed from what it sent, so a tensor
  corrupted or lost on the way to any rank is named (the worker's rank, the tensor's name).
* on the CPU platform only: vLLM's CPU build repacks linear layers after the first load, so the model's
  ``load_weights`` fails on a second load (its parameters lose ``weight_loader``). There the buckets are
  gathered and loaded once with the model runner's ``reload_weights``, which restores the layers first.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from verl.workers.rollout.vllm_rollout.utils import vLLMColocateWorkerExtension

from areal_plugins.rollout.verl_vllm.checksums import tensor_checksum

#: Fault injection for tests: ``NAME`` or ``NAME@K``: from this worker's K-th update on (default 1), the first
#: received value of tensor NAME is changed by +1, as a bad transport would.
CORRUPT_VARIABLE = "AREAL_CORRUPT_RECEIVED_WEIGHT"


class ArealVLLMWorkerExtension(vLLMColocateWorkerExtension):
    """verl's extension plus per-tensor checksums of what this worker received, and CPU-build loading."""

    model_runner: Any
    rank: int

    def update_weights_from_ipc(
        self, peft_config: Any = None, base_sync_done: bool = False, use_shm: bool = False
    ) -> Any:
        self.areal_received: dict[str, list[float]] = {}
        self.areal_updates = getattr(self, "areal_updates", 0) + 1
        if peft_config:
            raise NotImplementedError("areal_async with verl's vllm rollout does not support LoRA adapters yet")
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return super().update_weights_from_ipc(peft_config, base_sync_done, use_shm)
        return self._update_weights_on_cpu(use_shm)

    def _update_weights(self, weights: list[tuple[str, torch.Tensor]], peft_config: Any, base_sync_done: bool):
        self._record(weights)
        return super()._update_weights(weights, peft_config, base_sync_done)

    def _record(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        corrupt, _, first = os.environ.get(CORRUPT_VARIABLE, "").partition("@")
        if self.areal_updates < int(first or 1):
            corrupt = ""
        for name, tensor in weights:
            if name == corrupt:  # fault injection (tests): one received value changed, as a bad transport would
                tensor.view(-1)[0] += 1.0
            self.areal_received[name] = tensor_checksum(tensor)

    def _update_weights_on_cpu(self, use_shm: bool) -> None:
        from verl.workers.rollout.vllm_rollout.bucketed_weight_transfer import BucketedWeightReceiver

        received: list[tuple[str, torch.Tensor]] = []

        def keep(bucket: list[tuple[str, torch.Tensor]], is_last: bool) -> None:
            # The receiver reuses its buffer for the next bucket: copy out what this one holds.
            bucket = [(name, tensor.clone()) for name, tensor in bucket]
            self._record(bucket)
            received.extend(bucket)

        receiver = BucketedWeightReceiver(
            zmq_handle=self._get_zmq_handle(), device=torch.device("cpu"), use_shm=use_shm
        )
        receiver.receive_weights(on_bucket_received=keep)
        self.model_runner.reload_weights(weights_iterator=iter(received))

    def areal_weight_report(self) -> dict[str, Any]:
        """What this worker received in the last update: its rank and a checksum per tensor name."""
        return {"rank": int(getattr(self, "rank", 0)), "checksums": dict(getattr(self, "areal_received", {}))}
