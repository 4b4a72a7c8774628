"""``ArealServerAdapter``: the trainer-side end of our backends' weight sync (verl's ``BaseRollout``).

verl imports it by its path (``verl_registration.ADAPTER_FQN`` in ``_ROLLOUT_REGISTRY``): the module imports verl's
rollout base at its top, so nothing imports it before verl asks. Helpers are read from :mod:`.verl_registration` at
call time, where the tests replace them.
"""

from __future__ import annotations

import functools
from typing import Any

import ray
from verl.workers.rollout.base import BaseRollout

from areal_plugins.rollout import verl_registration as registration
from areal_plugins.rollout.base import record_weight_sync
from areal_plugins.weight_sync.checksums import tensor_checksum
from areal_plugins.weight_sync.errors import WeightSyncError
from areal_plugins.weight_sync.lora_updates import load_lora_update


class ArealServerAdapter(BaseRollout):
    """Trainer-side end of the weight sync: gathers full tensors, ships them, verifies the reply.

    ``resume``/``release`` are verl's wake-up and sleep calls of a colocated engine; they reach
    the server, which acts on them when ``free_cache_engine`` is true (as verl's vLLM adapter does).
    """

    def __init__(self, config: Any, model_config: Any, device_mesh: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(config, model_config, device_mesh)
        rollout_world = (
            self.config.tensor_model_parallel_size
            * self.config.data_parallel_size
            * self.config.pipeline_model_parallel_size
        )
        self.replica_rank, self.is_leader_rank = registration.replica_position(
            registration.process_rank(), rollout_world, kwargs.get("replica_rank", -1)
        )
        self.server_cls = registration.server_class(self.config.name)
        self._server: Any = None

    def _server_handle(self) -> Any:
        if self._server is None:
            self._server = ray.get_actor(registration.server_actor_name(self.config.name, self.replica_rank))
        return self._server

    async def resume(self, tags: list[str]) -> None:
        if self.is_leader_rank:
            await self._server_handle().wake_up.remote(tags=tags)

    async def release(self) -> None:
        if self.is_leader_rank:
            await self._server_handle().sleep.remote()

    async def update_weights(self, weights: Any, wire_format: str = "named_tensors", **kwargs: Any) -> None:
        """verl's ``peft_config`` and ``base_sync_done`` (colocated LoRA, ``engine_workers.update_weights``): with
        both, the tensors are the adapter alone, loaded by the server's ``update_adapter`` and checked tensor by
        tensor; with ``peft_config`` alone they are the base weights (sent once), loaded and checked as full
        weights."""
        if wire_format != "named_tensors":
            raise ValueError(f"the {self.config.name} backend takes full named tensors, not {wire_format!r}")
        # A checkpoint engine's stream may hold a LoRA update (placement: separate): loaded as verl's two calls.
        handled, outcome = await load_lora_update(
            weights, kwargs, functools.partial(self.update_weights, wire_format=wire_format)
        )
        if handled:
            return None
        weights = outcome  # the stream, whole
        # Every rank must drain the generator: producing full tensors is a collective. Checkpoint
        # engines hand weights over as a generator, some (verl's nccl) as an async one.
        if hasattr(weights, "__aiter__"):
            state = {name: tensor.detach().to("cpu", copy=True) async for name, tensor in weights}
        else:
            state = {name: tensor.detach().to("cpu", copy=True) for name, tensor in weights}
        peft_config = kwargs.get("peft_config")
        version = int(kwargs.get("global_steps") or 0)
        if registration.sends_lora_adapter(self.model_config) and not peft_config:
            # verl's own checkpoint-engine path sends the base weights without the adapter (verl issue #7495: the
            # engines sampled from the initial policy for the whole run); ours sends a LoRA update stream (read
            # above). Raised after the drain, so no rank of a transport is left waiting.
            raise WeightSyncError(
                f"rollout replica {self.replica_rank}, update {version}: the trainer trains a LoRA adapter "
                f"(actor_rollout_ref.model.lora_rank={self.model_config.lora_rank}) but this update carries no "
                "adapter, only base weights: the engines would sample from the base model, not the policy. "
                "Through a checkpoint engine the adapter goes only under areal.enable (patches/lora_separate_sync.py)"
            )
        if not self.is_leader_rank:
            return
        where = f"rollout replica {self.replica_rank}"
        if peft_config and kwargs.get("base_sync_done", False):  # verl's adapter-only update
            sent = {name: tensor_checksum(tensor) for name, tensor in state.items()}
            reply = await self._server_handle().update_adapter.remote(state, dict(peft_config), version)
            checked = self.server_cls.verify_adapter(reply, sent, version, where)
            record_weight_sync(self.replica_rank, version, {**checked, "adapter_only": True}, "update_checked")
            return
        reply = await self._server_handle().update_weights.remote(state, version)
        self.server_cls.verify_weights(reply, state, version, where)
