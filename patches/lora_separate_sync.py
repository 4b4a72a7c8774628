"""Patch: a LoRA adapter (and the base weights once) through a checkpoint engine, to engines in their own pool.

*Why*: verl 0.9.1's ``ActorRolloutRefWorker.update_weights`` sends, on its checkpoint-engine path (any backend but
``naive``: the separate placement), ``get_per_tensor_param()`` with its defaults. For a LoRA model without
``lora.merge`` that is the frozen base weights under ``.base_layer`` names, every update, and never the adapter: the
engines sample from the initial policy for the whole run, and nothing fails (verl issue #7495). The replacement sends
on that path what verl's colocated path sends, as one stream a checkpoint engine can carry
(:mod:`areal_plugins.weight_sync.lora_updates`): the base weights once (while verl's ``base_sync_done`` is false: the
engines started from ``load_format: dummy``), then the adapter alone on every update. Our server adapters read the
stream on the rollout side and load it as the colocated path does, so every adapter tensor is checked in the slots
the engines' forward passes read. Every other case (no LoRA, ``lora.merge: true``, ``naive``, ``delta_sharded``)
calls verl's method unchanged.
*Upstream*: verl PR #7496 (open) sends both phases on this path and passes ``peft_config`` to
``CheckpointEngineWorker.update_weights``. *Remove when*: verl PR #7496 lands;
``tests/unit/test_lora_separate_sync.py`` pins the verl 0.9.1 behaviour this replaces (the default-argument call on
the checkpoint-engine path) and fails when it changes.

Selected by ``actor_rollout_ref.model.lora_rank > 0`` without ``lora.merge`` under ``areal.enable`` with
``areal.placement: separate``; applied in the trainer's worker processes
(:func:`areal_plugins.driver.worker_calls.apply_patches_in_workers`).
"""

from __future__ import annotations

import functools
from typing import Any

from areal_plugins.patches._base import AttributePatch

from areal_plugins._compat import SUPPORTED_VERL
from areal_plugins.weight_sync.lora_updates import RESEND_BASE_ATTRIBUTE

TARGETS = (("verl.workers.engine_workers", "ActorRolloutRefWorker.update_weights"),)


#: The worker attribute saying the engines hold the base weights (verl's ``base_sync_done``, which verl sets only on
#: a worker that also hosts the rollout, never on the trainer of the separate placement).
BASE_SENT_ATTRIBUTE = "_areal_lora_base_sent"


def sends_adapter_through_engine(worker: Any, mode: str) -> bool:
    """Whether this update goes through a checkpoint engine and the trainer trains an unmerged adapter."""
    config = worker.config
    effective = mode if mode != "auto" else config.rollout.checkpoint_engine.backend
    if effective in ("naive", "delta_sharded") or bool((config.model.get("lora") or {}).get("merge", False)):
        return False
    module = worker.actor.engine.module
    return hasattr(getattr(module, "_fsdp_wrapped_module", module), "peft_config")


async def send_lora_update(worker: Any, global_steps: Any) -> dict:
    """The adapter (after the base weights, while the engines lack them) through the worker's checkpoint engine."""
    from areal_plugins.weight_sync.lora_updates import lora_update_stream

    engine, summon = worker.actor.engine, bool(worker.config.rollout.get("layered_summon", False))
    adapter, peft_config = engine.get_per_tensor_param(layered_summon=summon, base_sync_done=True)
    # As verl's colocated path decides: engines started from dummy weights need the base once.
    base_sent = getattr(worker, BASE_SENT_ATTRIBUTE, "dummy" not in str(worker.config.rollout.load_format))
    base = None
    if not base_sent or getattr(worker.checkpoint_engine, RESEND_BASE_ATTRIBUTE, False):
        # verl's collect_lora_params refuses layered_summon for the base (it gathers the base on the host anyway).
        base, _ = engine.get_per_tensor_param(layered_summon=False, base_sync_done=False)
    stream = lora_update_stream(base, adapter, dict(peft_config))
    metrics = await worker.checkpoint_engine.send_weights(stream, global_steps=global_steps)
    setattr(worker, BASE_SENT_ATTRIBUTE, True)
    setattr(worker.checkpoint_engine, RESEND_BASE_ATTRIBUTE, False)
    return metrics or {}


def _make_replacement(original: Any) -> Any:
    @functools.wraps(original)
    async def update_weights(self: Any, global_steps: int | None = None, mode: str = "auto") -> Any:
        if not sends_adapter_through_engine(self, mode):
            return await original(self, global_steps=global_steps, mode=mode)
        return await send_lora_update(self, global_steps)

    return update_weights


PATCH = AttributePatch("lora_separate_sync", TARGETS, _make_replacement, SUPPORTED_VERL)
apply = PATCH.apply
revert = PATCH.revert
is_applied = PATCH.is_applied
