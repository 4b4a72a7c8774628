"""verl's vLLM server adapter, plus the check that every vLLM worker received what the trainer sent.

Registered for ``rollout.name: vllm`` in every process (verl's ``_ROLLOUT_REGISTRY``, by name, imported only when
used). It adds something only when its server is ours (:class:`~areal_plugins.rollout.verl_vllm.server.
ArealVLLMHttpServer`, which only ``areal_async`` builds); under verl's own trainers it is verl's adapter.

A tensor larger than verl's transfer bucket that verl's direct path cannot carry (one on the host, as ``areal_gloo``
delivers them, or any where the transport is shared memory) goes as pieces that our worker extension joins before
loading (weight_sync/split_tensors.py), on every rank of a replica whose workers run our extension
(``rollout.custom.areal_joins_pieces``, which our trainers set: :func:`~areal_plugins.rollout.verl_vllm.server.
use_checked_vllm_replicas`).

Under LoRA (verl's adapter-only update: ``peft_config`` with ``base_sync_done``) the comparison is the adapter's:
every adapter tensor each worker holds in the slots its forward pass reads, against what the trainer sent
(weight_sync/adapter_check.py); the base weights, sent once before the first adapter, are checked as full weights.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

from verl.workers.rollout.utils import ensure_async_iterator
from verl.workers.rollout.vllm_rollout.vllm_rollout import ServerAdapter

from areal_plugins.rollout.base import record_weight_sync
from areal_plugins.weight_sync.adapter_check import check_adapter_reports, check_base_rechecks
from areal_plugins.weight_sync.checksums import PendingChecksums, check_loaded_reports, check_weight_reports
from areal_plugins.weight_sync.lora_updates import load_lora_update
from areal_plugins.weight_sync.split_tensors import JOINS_PIECES_KEY, cut_large


class ArealServerAdapter(ServerAdapter):
    async def update_weights(  # type: ignore[override]  # verl's ServerAdapter's signature, as verl overrides it
        self, weights: Any, global_steps: Any = None, wire_format: str = "named_tensors", **kwargs: Any
    ) -> Any:
        try:
            return await self._update_weights(weights, global_steps, wire_format, **kwargs)
        finally:
            # A transport that streams (areal_gloo without a stage) must take the rest of its update even when the
            # load stopped part-way, or its sender and the other workers wait out their timeout: close it now, not
            # whenever the garbage collector gets to it.
            await close_weights(weights)

    async def _update_weights(self, weights: Any, global_steps: Any, wire_format: str, **kwargs: Any) -> Any:
        if wire_format != "named_tensors":
            return await super().update_weights(weights, global_steps, wire_format, **kwargs)
        # A checkpoint engine's stream may hold a LoRA update (placement: separate): loaded as verl's two calls.
        load = functools.partial(self._update_weights, global_steps=global_steps, wire_format=wire_format)
        handled, outcome = await load_lora_update(weights, kwargs, load)
        if handled:
            return outcome  # the adapter load's result
        weights = outcome  # the stream, whole
        if not self._serves_areal():  # verl's adapter, or a rank of our replica that does not read the reports
            return await super().update_weights(self._cut(weights), global_steps, wire_format, **kwargs)
        sent: dict[str, list[float]] = {}
        pending = PendingChecksums()  # one host copy per update, not one per tensor
        taken_by_transport: dict[str, PendingChecksums] = {}

        async def checksummed() -> Any:
            async for name, tensor in ensure_async_iterator(weights):
                # What this adapter passes on: the trainer's own tensors when colocated; in separate, what the
                # checkpoint engine delivered (its leg is checked by the manager: weight_sync/checked_transfer.py).
                # A checkpoint engine that checked its leg took it already (areal_gloo, our nccl mixin). Of the
                # whole tensor, before it is cut: the worker takes its checksum after joining the pieces.
                known = getattr(tensor, "areal_checksum", None)
                if known is not None:
                    sent[name] = known
                elif (transport := getattr(tensor, "areal_pending_checksums", None)) is not None:
                    taken_by_transport[name] = transport
                else:
                    pending.add(name, tensor)
                yield name, tensor

        result = await super().update_weights(self._cut(checksummed()), global_steps, wire_format, **kwargs)
        sent.update(pending.resolve())
        resolved = {id(transport): transport.resolve() for transport in taken_by_transport.values()}
        sent.update({name: resolved[id(transport)][name] for name, transport in taken_by_transport.items()})
        if self._has_server:  # every worker has received by now: verl awaits their collective_rpc
            reports = await self.server_handle.areal_weight_reports.remote()
            if kwargs.get("peft_config") and kwargs.get("base_sync_done"):  # verl's adapter-only update (LoRA)
                self._check_adapter(reports, sent, int(global_steps or 0))
                return result
            where = f"rollout replica {self.replica_rank}"
            check_weight_reports(reports, sent, where, self._workers_per_replica())
            loaded = check_loaded_reports(reports, where)
            checked = {"tensors": len(sent), "workers": sorted(int(report["rank"]) for report in reports), **loaded}
            joined = sorted({name for report in reports for name in report.get("joined") or []})
            if joined:  # tensors larger than the bucket, cut for verl's transport and joined by the workers
                checked["joined"] = joined
            record_weight_sync(self.replica_rank, int(global_steps or 0), checked, "update_checked")
        return result

    def _check_adapter(self, reports: list[dict[str, Any]], sent: dict[str, list[float]], version: int) -> None:
        """Every worker of this replica holds, in the slots its forward pass reads, the adapter the trainer sent
        (weight_sync/adapter_check.py; each worker's report: rollout/verl_vllm/loaded_adapter.py)."""
        replica = [{**report, "replica": self.replica_rank} for report in reports]
        checked = check_adapter_reports(sent, replica, version, self._workers_per_replica())
        checked["base_rechecked"] = check_base_rechecks(reports, f"rollout replica {self.replica_rank}", version)
        workers = sorted(int(report["rank"]) for report in reports)
        record_weight_sync(
            self.replica_rank, version, {**checked, "workers": workers, "adapter_only": True}, "update_checked"
        )

    def _cut(self, weights: Any) -> Any:
        """``weights`` with each tensor that verl's sender could not send whole given as pieces, where this replica's
        workers join them (our extension); as they are elsewhere (verl's own trainers, verl's extension)."""
        custom = getattr(self.config, "custom", None) or {}
        if not custom.get(JOINS_PIECES_KEY):
            return weights
        # verl's sender's bucket: the same key, the same rounding to whole megabytes.
        bucket_bytes = int(self.config.checkpoint_engine.update_weights_bucket_megabytes) << 20
        return cut_large(ensure_async_iterator(weights), bucket_bytes, self._direct_path_fails)

    def _direct_path_fails(self, tensor: Any) -> bool:
        """Whether verl's sender cannot send ``tensor``, larger than its bucket, by its direct path: over shared
        memory it refuses any (an assertion), and the handle it sends (``reduce_tensor``) is rebuilt by the receiver
        as a device's IPC handle, which a tensor on the host does not have (the receiver fails, the sender waits)."""
        return bool(self.use_shm) or tensor.device.type == "cpu"

    def _workers_per_replica(self) -> int:
        """vLLM workers of one replica, as verl counts a replica's ranks (no prefill/decode split here)."""
        config = self.config
        return config.tensor_model_parallel_size * config.data_parallel_size * config.pipeline_model_parallel_size

    def _serves_areal(self) -> bool:
        if not self._ensure_server_handle():
            return False
        return hasattr(self.server_handle, "areal_weight_reports")  # a Ray handle has the actor class's methods


async def close_weights(weights: Any) -> None:
    """Close a generator of weights (sync or async); a no-op for one that is done or a list."""
    if inspect.isasyncgen(weights):
        await weights.aclose()
    elif inspect.isgenerator(weights):
        weights.close()
