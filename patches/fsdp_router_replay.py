"""Patch: router replay (R3) in verl's FSDP engine, from the routes the rollout engine recorded.

*Why*: verl 0.9.1 replays routes only in its Megatron and VeOmni engines (``router_replay.mode``); its FSDP engine
(``strategy: fsdp`` / ``fsdp2``, what ``areal.enable`` trains with) never reads the ``routed_experts`` its batch
carries, so a mixture-of-experts policy's trainer routes tokens its own way and its log-probs drift from the
engine's. The replacement of ``FSDPEngineWithLMHead.prepare_model_inputs`` calls verl's, then arms the model's
routers with the micro-batch's recorded routes, laid out as verl just laid out ``input_ids`` (packed with the pad
suffix, or right-padded); :mod:`areal_plugins.trainer_workers.router_replay` does the routing. Every forward pass of
the engine replays: the proximal (old) log-prob pass, the update, and a reference model's pass.
*Upstream*: no seam in verl 0.9.1 (the FSDP engine has no router-replay hook; VeOmni's engine subclasses it and arms
its own controller in the same method). *Remove when*: verl's FSDP engine reads ``routed_experts``; watch verl issue
#5392 (open: routing replay under FSDP training) and verl PR #4443 (open: routing replay with SGLang and FSDP).

Selected by ``actor_rollout_ref.rollout.enable_rollout_routing_replay: true`` under ``areal.enable``; the trainer
applies it inside its worker processes (:func:`areal_plugins.driver.worker_calls.apply_patches_in_workers`).
Ulysses sequence parallelism is refused at startup with it (the slices are not replayed here).
"""

from __future__ import annotations

import functools
from typing import Any

from areal_plugins.patches._base import AttributePatch

from areal_plugins._compat import SUPPORTED_VERL

TARGETS = (("verl.workers.engine.fsdp.transformer_impl", "FSDPEngineWithLMHead.prepare_model_inputs"),)
#: The engine attribute holding its model's :class:`~areal_plugins.trainer_workers.router_replay.RouterReplay`.
REPLAY_ATTRIBUTE = "_areal_router_replay"
#: The engine attribute holding its model's decoder-layer count (the recorded routes' layer axis is checked on it).
LAYERS_ATTRIBUTE = "_areal_decoder_layers"


def arm_from_micro_batch(engine: Any, micro_batch: Any, model_inputs: dict[str, Any], output_args: dict) -> None:
    """Arm ``engine``'s routers with ``micro_batch``'s ``routed_experts`` in the layout of ``model_inputs``."""
    from verl.utils import tensordict_utils as tu

    from areal_plugins.core.routing import RouterReplayError, decoder_layers
    from areal_plugins.trainer_workers import router_replay

    replay = getattr(engine, REPLAY_ATTRIBUTE, None)
    if replay is None:
        replay = router_replay.RouterReplay.install(engine.module)
        setattr(engine, REPLAY_ATTRIBUTE, replay)
        setattr(engine, LAYERS_ATTRIBUTE, len(decoder_layers(engine.module)))  # counted once, not per micro-batch
    routed = micro_batch.get("routed_experts", None)
    if routed is None:
        raise RouterReplayError(
            "router replay: this micro-batch carries no routed_experts (the rollout backend did not record the "
            "engine's routes); use a backend that records them, or set "
            "actor_rollout_ref.rollout.enable_rollout_routing_replay=false"
        )
    if getattr(engine, "use_ulysses_sp", False):
        raise RouterReplayError(
            "router replay with Ulysses sequence parallelism is not replayed here; set "
            "actor_rollout_ref.actor.ulysses_sequence_parallel_size=1"
        )
    if tu.get_non_tensor_data(data=micro_batch, key="use_remove_padding", default=True):
        rows = router_replay.packed_rows(routed, int(output_args.get("pad_size", 0)))
    else:
        rows = router_replay.padded_rows(routed, int(model_inputs["input_ids"].shape[1]))
    replay.arm(rows, getattr(engine, LAYERS_ATTRIBUTE))
    router_replay.ARMED = replay


def _make_replacement(original: Any) -> Any:
    @functools.wraps(original)
    def prepare_model_inputs(self: Any, micro_batch: Any) -> Any:
        model_inputs, output_args = original(self, micro_batch)
        arm_from_micro_batch(self, micro_batch, model_inputs, output_args)
        return model_inputs, output_args

    return prepare_model_inputs


PATCH = AttributePatch("fsdp_router_replay", TARGETS, _make_replacement, SUPPORTED_VERL)
apply = PATCH.apply
revert = PATCH.revert
is_applied = PATCH.is_applied
