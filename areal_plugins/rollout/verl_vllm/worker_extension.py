"""The vLLM worker extension of verl's ``vllm`` rollout under ``areal_async``.

verl's extension (``vLLMColocateWorkerExtension``) receives the trainer's weights in buckets (CUDA IPC on a GPU,
shared memory elsewhere) and loads each bucket with the model's ``load_weights``. Ours adds:

* a checksum per received tensor, ``[elements, Σx, Σx², Σ wᵢxᵢ]`` in float64 (weights/checksums.py), computed where
  the tensor lies (on a GPU, reduction kernels on the device, read to the host once per update), after the transport
  and before loading. The trainer compares it with the same numbers computed from what it sent, so a tensor
  corrupted or lost on the way to any rank is named (the worker's rank, the tensor's name).
* after loading, a checksum of every parameter the worker holds, beside the sum of the checksums of the tensors it
  loaded into it (rollout/verl_vllm/loaded_weights.py): a tensor loaded wrong, into the wrong place, or not at all
  is named, where vLLM itself at most logs a warning.
* a tensor that the adapter cut into pieces (larger than the transfer bucket, where verl's direct path cannot carry
  it: weight_sync/split_tensors.py) is joined before it is checksummed and loaded.
* on the CPU platform only: vLLM's CPU build repacks linear layers after the first load, so the model's
  ``load_weights`` fails on a second load (its parameters lose ``weight_loader``). There the buckets are
  gathered and loaded once with the model runner's ``reload_weights``, which restores the layers first. A
  mixture of experts' fused expert weights are then packed for vLLM's CPU kernel by
  patches/vllm_cpu_moe_reload.py: vLLM 0.30 skips that on a reload.
* LoRA (verl's adapter-only update, ``peft_config`` with ``base_sync_done``): verl's own loading (``add_lora`` with
  a ``TensorLoRARequest``, on every platform: the base layers are not touched), then a report of every adapter
  tensor this worker holds in the slots its forward pass reads, beside what it received and what it should hold
  (rollout/verl_vllm/loaded_adapter.py; compared by weight_sync/adapter_check.py). A module of which only one of
  ``lora_A``/``lora_B`` arrived stops the update here, naming the missing tensor: vLLM would fail inside
  ``add_lora`` without naming it.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from verl.workers.rollout.vllm_rollout.utils import vLLMColocateWorkerExtension

from areal_plugins.rollout.verl_vllm.loaded_weights import (
    ReceivedChecksums,
    ReceivedTensor,
    base_kept,
    loaded_report,
    recheck_held,
)
from areal_plugins.testing.faults import fault_plan
from areal_plugins.weight_sync.split_tensors import Joiner


class ArealVLLMWorkerExtension(vLLMColocateWorkerExtension):
    """verl's extension plus per-tensor checksums of what this worker received, and CPU-build loading."""

    model_runner: Any
    rank: int
    #: Tests only: True takes verl's in-place loading (the GPU path) on the CPU platform too, with vLLM's CPU kernels
    #: made to keep their weights (tests/verl_vllm/test_gpu_load_path.py); None: the GPU path except on the CPU.
    areal_load_in_place: bool | None = None

    def __new__(cls, **kwargs: Any) -> Any:
        # verl's LoRA loader calls a WeightsMapper method that vLLM 0.30 renamed (patches/vllm_lora_mapper.py).
        if getattr(kwargs.get("vllm_config"), "lora_config", None) is not None:
            from areal_plugins.patches import vllm_lora_mapper

            vllm_lora_mapper.apply()
        return super().__new__(cls, **kwargs)

    def update_weights_from_ipc(
        self, peft_config: Any = None, base_sync_done: bool = False, use_shm: bool = False
    ) -> Any:
        self.areal_received: dict[str, list[float]] = {}
        self.areal_received_tensors: dict[str, ReceivedTensor] = {}
        self.areal_arriving = ReceivedChecksums(self._engine_dtype())
        self.areal_loaded: dict[str, Any] | None = None
        self.areal_updates = getattr(self, "areal_updates", 0) + 1
        self.areal_joiner = Joiner()
        self.areal_adapter: dict[str, Any] | None = None
        self.areal_adapter_received: dict[str, torch.Tensor] = {}
        self.areal_unpaired: list[tuple[str, str]] = []
        from vllm.platforms import current_platform

        adapter_only = bool(peft_config) and bool(base_sync_done)
        model = self.model_runner.model
        result = None
        in_place = not current_platform.is_cpu() if self.areal_load_in_place is None else self.areal_load_in_place
        if adapter_only or in_place:  # verl's loading (an adapter leaves the base layers be)
            result = super().update_weights_from_ipc(peft_config, base_sync_done, use_shm)
        else:
            self._update_weights_on_cpu(use_shm, peft_config)
        self.areal_joiner.finish()
        self.areal_received_tensors = self.areal_arriving.resolve()  # one host read for every tensor received
        self.areal_received = {name: received.checksum for name, received in self.areal_received_tensors.items()}
        self.areal_base_recheck: dict[str, Any] | None = None
        if adapter_only:
            self._require_pairs()
            self._report_adapter(peft_config)
            # The base, sent once, against its checksums kept from that load (the engine slept and woke since).
            self.areal_base_recheck = recheck_held(model, getattr(self, "areal_base_kept", {}))
        else:
            self._report_loaded(model)
            self.areal_base_kept = base_kept(self.areal_loaded)
        return result

    def _report_adapter(self, peft_config: Any) -> None:
        from vllm.lora.peft_helper import PEFTHelper

        from areal_plugins.rollout.verl_vllm.loaded_adapter import adapter_report, corrupt_slot, held_adapter

        manager = self.model_runner.lora_manager._adapter_manager
        corrupt = fault_plan().loaded_target(self.areal_updates)
        if corrupt:  # fault injection (tests: testing/faults.py): one value the forward pass reads
            corrupt_slot(manager, corrupt)
        held = held_adapter(manager, list(self.areal_adapter_received))
        scaling = float(PEFTHelper.from_dict(dict(peft_config)).vllm_lora_scaling_factor)
        self.areal_adapter = (
            None if held is None else adapter_report(held, self.areal_adapter_received, self.areal_received, scaling)
        )
        self.areal_adapter_received = {}

    def _report_loaded(self, model: Any) -> None:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_world_size

        corrupt = fault_plan().loaded_target(self.areal_updates)
        if corrupt:  # fault injection (tests: testing/faults.py): one value of the engine's parameter changed
            with torch.no_grad():
                dict(model.named_parameters())[corrupt].view(-1)[0] += 1.0
        vllm_config = self.model_runner.vllm_config
        self.areal_loaded = loaded_report(
            model,
            self.areal_received_tensors,
            self._engine_dtype(),
            get_tensor_model_parallel_world_size(),
            quantized=getattr(vllm_config, "quant_config", None) is not None,
            tied_embeddings=bool(getattr(vllm_config.model_config.hf_config, "tie_word_embeddings", False)),
            shard_group=self._shard_group(),
        )

    @staticmethod
    def _shard_group() -> tuple[int, int]:
        """This worker's (data-parallel, pipeline) ranks: the tensor-parallel shards of a parameter add up within
        one such group (a group vLLM has not built is rank 0)."""
        from vllm.distributed import parallel_state

        ranks = []
        for getter in ("get_dp_group", "get_pp_group"):
            try:
                ranks.append(int(getattr(parallel_state, getter)().rank_in_group))
            except (AssertionError, AttributeError):  # not initialized, or absent in this vLLM
                ranks.append(0)
        return ranks[0], ranks[1]

    def _update_weights(self, weights: list[tuple[str, torch.Tensor]], peft_config: Any, base_sync_done: bool):
        # verl's loading of one bucket (GPU path): the pieces of a cut tensor become the tensor once all arrived.
        weights = self.areal_joiner.take(weights)
        if not weights:  # the bucket held only pieces of a tensor still arriving
            return None
        weights = self._record(weights)
        if peft_config and base_sync_done:  # verl hands over the whole adapter at once
            from areal_plugins.rollout.verl_vllm.loaded_adapter import rename_mapper, unpaired

            self.areal_adapter_received.update(weights)
            self.areal_unpaired = unpaired([name for name, _ in weights], rename_mapper(self.model_runner.model))
            if self.areal_unpaired:  # not loaded; raised once the transfer has ended (_require_pairs)
                return None
        return super()._update_weights(weights, peft_config, base_sync_done)

    def _require_pairs(self) -> None:
        """Raise where only one of a module's ``lora_A``/``lora_B`` arrived (vLLM would fail inside ``add_lora``
        without naming it). Raised after verl's receiver has ended: from inside its loop the error would be masked
        by the receiver's own failure to close the shared memory the bucket's tensors still point into."""
        from areal_plugins.weight_sync.errors import WeightSyncError

        halves = getattr(self, "areal_unpaired", [])
        if halves:
            missing, present = halves[0]
            replica = os.environ.get("VERL_REPLICA_RANK", "?")
            raise WeightSyncError(
                f"rollout replica {replica}, engine rank {int(getattr(self, 'rank', 0))}, this worker's update "
                f"{self.areal_updates}: adapter tensor {missing} never arrived, though {present} did "
                f"({len(halves)} such module(s)): the engine cannot load half an adapter; stopping"
            )

    def _record(self, weights: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        """Checksum what arrived (after the tests' fault injection: testing/faults.py); what arrived, to load."""
        arrived = fault_plan().received(weights, self.areal_updates)
        for name, tensor in arrived:  # reduced on the device now, read to the host once the update has arrived
            self.areal_arriving.add(name, tensor)
        return arrived

    def _engine_dtype(self) -> torch.dtype:
        return self.model_runner.vllm_config.model_config.dtype

    def _update_weights_on_cpu(self, use_shm: bool, peft_config: Any = None) -> None:
        from verl.workers.rollout.vllm_rollout.bucketed_weight_transfer import BucketedWeightReceiver

        received: list[tuple[str, torch.Tensor]] = []

        def keep(bucket: list[tuple[str, torch.Tensor]], is_last: bool) -> None:
            # The receiver reuses its buffer for the next bucket: copy out what this one holds (a joined tensor is
            # a copy already).
            bucket = self.areal_joiner.take(bucket, copy_others=True)
            received.extend(self._record(bucket))

        receiver = BucketedWeightReceiver(
            zmq_handle=self._get_zmq_handle(), device=torch.device("cpu"), use_shm=use_shm
        )
        receiver.receive_weights(on_bucket_received=keep)
        model = self.model_runner.model
        if any("w13_weight" in module._parameters for module in model.modules()):  # fused experts
            from areal_plugins.patches import vllm_cpu_moe_reload

            vllm_cpu_moe_reload.apply()
        if peft_config:  # LoRA's base weights (``.base_layer`` names): verl's name reconciliation, as on a GPU
            from verl.utils.vllm import resolve_weight_name

            names = {n for n, _ in model.named_parameters(remove_duplicate=False)}
            names.update(n for n, _ in model.named_buffers())
            received = [(resolve_weight_name(model, name, names), tensor) for name, tensor in received]
        self.model_runner.reload_weights(weights_iterator=iter(received))

    def areal_weight_report(self) -> dict[str, Any]:
        """What this worker received in the last update (its rank, a checksum per tensor name), what it holds
        after loading it (``loaded``: rollout/verl_vllm/loaded_weights.py; ``adapter`` for a LoRA adapter:
        rollout/verl_vllm/loaded_adapter.py, None where it holds none) and which tensors arrived in pieces."""
        from vllm.distributed.parallel_state import get_tensor_model_parallel_world_size

        joiner = getattr(self, "areal_joiner", None)
        return {
            "rank": int(getattr(self, "rank", 0)),
            "checksums": dict(getattr(self, "areal_received", {})),
            "loaded": getattr(self, "areal_loaded", None),
            "adapter": getattr(self, "areal_adapter", None),
            "base_recheck": getattr(self, "areal_base_recheck", None),
            "tensor_parallel_size": get_tensor_model_parallel_world_size(),
            "shard_group": list(self._shard_group()),
            "joined": list(joiner.joined) if joiner is not None else [],
        }
