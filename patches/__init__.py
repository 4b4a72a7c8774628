"""Version-guarded patches of verl, applied only for the features that need them.

Seams first: everything verl lets us register (platform, rollout backend, policy loss, trainer,
sampler, LLM client, verl's vLLM replica and adapter) is registered, not patched. A module here
exists only where verl 0.9.1 has no seam; each says why, where upstream stands and when to delete it.

``apply_enabled_patches(config)`` is the one entry point: it walks :data:`PATCHES` in order and
applies each patch whose feature is enabled. Ten exist: the CPU platform's four (selected by
``VERL_PLATFORM=cpu``, applied at plugin load in every process: gloo, vLLM's CPU build seen as ``vllm``,
the trainer's port chosen outside the ephemeral range, and verl's FSDP1 engine: its weights broadcast over gloo
and kept on the CPU), the routing of ``areal.enable`` in
any recipe (applied at plugin load in verl's ``main_ppo`` driver only) and token-budget micro-batching
(FFD, or runs of like length where verl pads)
(selected by ``areal.micro_batch.max_tokens``) and the count of micro-batches the stall guard reads as
progress (selected by ``areal.enable`` with ``areal.mode: async``) and router replay into verl's FSDP engine
(selected by ``actor_rollout_ref.rollout.enable_rollout_routing_replay`` under ``areal.enable``) and a LoRA adapter
sent through the checkpoint engine (selected by an unmerged ``lora_rank > 0`` with ``areal.placement: separate``) and a
vision-language model's M-RoPE positions kept ragged in their tokens (under ``areal.enable``, whatever the model: it
touches only three-dimensional position tensors); the trainer applies these five in its worker
processes with :func:`areal_plugins.driver.worker_calls.apply_patches_in_workers`, since only the driver sees the
recipe. With ``areal.enable: false`` on a GPU machine only the routing wrapper is installed, in the driver, and it
passes verl's config through unchanged.

Two more are not in :data:`PATCHES`: our vLLM worker extension applies them in vLLM's worker processes, where vLLM's
model code is imported anyway (at plugin load it would be imported in every process): ``vllm_lora_mapper`` (verl's
LoRA loader on vLLM 0.30's renamed mapper method) when the engine serves LoRA, the only processes where verl loads
an adapter, and ``vllm_cpu_moe_reload`` (reloaded expert weights packed for vLLM 0.30's CPU kernel, which vLLM
skips) on the CPU platform before it reloads an update into a mixture of experts.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

from areal_plugins.patches import (
    fsdp1_cpu,
    fsdp_router_replay,
    gloo_backend,
    lora_separate_sync,
    master_port,
    micro_batch_partitioner,
    route_areal_node,
    trainer_progress,
    vllm_cpu_distribution,
    vlm_position_ids,
)


def _cpu_platform(config: Any) -> bool:
    from areal_plugins.platforms.cpu import cpu_platform_selected

    return cpu_platform_selected()


def _verl_driver(config: Any) -> bool:
    """This process is verl's ``main_ppo`` driver, where the recipe is composed (plugin load only).

    Under ``python -m verl.trainer.main_ppo`` verl is imported (and this asked) while ``sys.argv[0]``
    is still ``-m``: the interpreter's original command line says which module runs.
    """
    import sys
    from pathlib import Path

    command = [*getattr(sys, "orig_argv", []), sys.argv[0]]
    return config is None and ("verl.trainer.main_ppo" in command or Path(sys.argv[0]).name == "main_ppo.py")


def _token_budget_micro_batches(config: Any) -> bool:
    from areal_plugins.config.settings import areal_settings

    areal = areal_settings(config)  # no areal node: the defaults, enable false
    return areal.enable and areal.micro_batch.max_tokens is not None


def _async_trainer(config: Any) -> bool:
    from areal_plugins.config.settings import areal_settings

    return areal_settings(config).async_trainer


def _router_replay(config: Any) -> bool:
    """Router replay into the trainer (``enable_rollout_routing_replay`` under ``areal.enable``)."""
    from areal_plugins.config.settings import areal_settings

    if not areal_settings(config).enable:
        return False
    rollout = (config.get("actor_rollout_ref") or {}).get("rollout") or {}
    return bool(rollout.get("enable_rollout_routing_replay", False))


def _lora_through_checkpoint_engine(config: Any) -> bool:
    """An unmerged LoRA adapter to engines in their own pool (``lora_rank > 0``, ``placement: separate``)."""
    from areal_plugins.config.settings import areal_settings

    areal = areal_settings(config)
    if not areal.enable or areal.placement != "separate":
        return False
    model = (config.get("actor_rollout_ref") or {}).get("model") or {}
    return int(model.get("lora_rank", 0) or 0) > 0 and not bool((model.get("lora") or {}).get("merge", False))


def _areal_trainer(config: Any) -> bool:
    """``areal.enable`` in the recipe (the run's worker patches; config None: at plugin load, not yet)."""
    from areal_plugins.config.settings import areal_settings

    return config is not None and areal_settings(config).enable


#: (feature, is it enabled for this run?, patch), in the order they are applied.
PATCHES: tuple[tuple[str, Callable[[Any], bool], ModuleType], ...] = (
    ("cpu platform (VERL_PLATFORM=cpu)", _cpu_platform, gloo_backend),
    (
        "cpu platform (VERL_PLATFORM=cpu): vLLM's CPU build for verl's vllm rollout",
        _cpu_platform,
        vllm_cpu_distribution,
    ),
    ("cpu platform (VERL_PLATFORM=cpu): the trainer's port outside the ephemeral range", _cpu_platform, master_port),
    (
        "cpu platform (VERL_PLATFORM=cpu): verl's FSDP1 engine (weights broadcast over gloo, kept on the CPU)",
        _cpu_platform,
        fsdp1_cpu,
    ),
    ("areal.enable in any recipe (verl's main_ppo driver)", _verl_driver, route_areal_node),
    ("areal.micro_batch.max_tokens", _token_budget_micro_batches, micro_batch_partitioner),
    ("areal_async's stall guard: trainer workers report micro-batches", _async_trainer, trainer_progress),
    ("router replay (R3) in the trainer: enable_rollout_routing_replay", _router_replay, fsdp_router_replay),
    ("LoRA adapter-only in the separate placement", _lora_through_checkpoint_engine, lora_separate_sync),
    # Whatever the model (a hub id's config is not read at startup); it changes only 3-D position tensors (VLMs).
    ("a vision-language model's M-RoPE positions in the trainer", _areal_trainer, vlm_position_ids),
)


def enabled_patches(config: Any = None) -> list[ModuleType]:
    """The patches the run needs, in order. ``config``: the composed recipe, or None at plugin load."""
    return [patch for _, enabled, patch in PATCHES if enabled(config)]


def apply_enabled_patches(config: Any = None) -> list[str]:
    """Apply what :func:`enabled_patches` lists; return the applied modules' names."""
    applied = []
    for patch in enabled_patches(config):
        patch.apply()
        applied.append(patch.__name__)
    return applied


def apply_by_name(names: list[str]) -> None:
    """Apply the patches named by module (what the driver sends a worker process that has not seen the recipe)."""
    import importlib

    for name in names:
        importlib.import_module(name).apply()
