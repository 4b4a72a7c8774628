"""Loaded by verl in every process (entry point group ``verl.plugins``), Ray workers included.

It only registers: the CPU platform, our rollout backend ``areal_cpu`` and checked vLLM adapter, our
``areal_gloo`` checkpoint engine and the checksums of verl's ``nccl`` (weight_sync/checked_transfer.py), the
``areal_decoupled`` policy losses, the ``areal_*`` trainer modes, config resolvers and, when this process
runs verl on the CPU platform (``VERL_PLATFORM=cpu``), the patches verl needs there.

Registration is lazy: each of verl's registries lives in a module that ``import verl`` does not load (the V1
trainer, the rollout workers, the losses, the checkpoint engines), so importing them here would make every verl
process pay for all of them. Instead the post-import hook (:mod:`areal_plugins.patches._after_import`) watches for
the registry's module and registers our names the moment that module has finished importing, which is before
anything can look a name up in it. A registry module imported already when we load is served at once. verl logs a
plugin's load failure at debug level only, so failures here are logged as errors instead.
"""

from __future__ import annotations

import logging
import os
import sys

from areal_plugins.patches._after_import import AfterImport, describe, installed

logger = logging.getLogger("areal_plugins")

#: Set in every process where registration succeeded, so that tests and the CLI can check it.
LOADED = False

#: verl's registry module -> our registrations (``module:function``) run once it has been imported, in order.
#: Each function is idempotent and imports what it registers only when called.
REGISTRATIONS: dict[str, tuple[str, ...]] = {
    "verl.plugin.platform": ("areal_plugins.platforms.cpu:register_cpu_platform",),
    "verl.workers.rollout.base": ("areal_plugins.rollout.verl_registration:register_rollout_adapters",),
    "verl.workers.rollout.replica": ("areal_plugins.rollout.verl_registration:register_rollout_replicas",),
    "verl.trainer.ppo.core_algos": ("areal_plugins.trainer_workers.policy_loss:register_policy_loss_with_verl",),
    "verl.trainer.ppo.v1": ("areal_plugins.driver:register_trainers",),
    # The package, not .base: verl's own engines (nccl, ...) are registered by its __init__, and we wrap them.
    "verl.checkpoint_engine": (
        "areal_plugins.weight_sync.gloo:register_gloo_checkpoint_engine",
        "areal_plugins.weight_sync.checked_transfer:register_checked_checkpoint_engines",
    ),
}


def _finder() -> AfterImport | None:
    return next((f for f in sys.meta_path if isinstance(f, AfterImport)), None)


def register_with_verl() -> None:
    """Register what is cheap now and watch verl's registry modules for the rest (:data:`REGISTRATIONS`).

    Idempotent: one watcher per process.
    """
    global LOADED
    from areal_plugins._compat import UnsupportedVerlVersionError, check_verl_version

    try:
        check_verl_version()
    except UnsupportedVerlVersionError as error:
        logger.error("areal_plugins disabled: %s", error)
        return
    finder = installed()  # the patches that wait for their module (AttributePatch.on_import) share it
    for name, targets in REGISTRATIONS.items():
        for target in targets:
            finder.watch(name, target)
    _register_config_resolvers()
    from areal_plugins.platforms.cpu import cpu_platform_selected

    if cpu_platform_selected():
        # verl's FSDP engine is registered for cuda/npu only; its code is device-agnostic
        # through the platform, so look it up under "cuda" (verl's own override knob).
        os.environ.setdefault("VERL_ENGINE_DEVICE", "cuda")
    from areal_plugins.patches import apply_enabled_patches

    apply_enabled_patches()
    LOADED = True


def pending_registrations() -> dict[str, list[str]]:
    """verl modules not imported yet in this process -> the registrations waiting for them."""
    finder = _finder()
    return {} if finder is None else {name: [describe(t) for t in targets] for name, targets in finder.pending.items()}


def _register_config_resolvers() -> None:
    """Resolvers our recipes and config group use.

    ``${areal_package_path:rel}``: a file inside the installed package (recipes name our reward fn).
    ``${areal_verl:name,${areal}}``: a verl setting routed by the ``areal:`` node (validated here).
    """
    from pathlib import Path

    from omegaconf import OmegaConf

    from areal_plugins.config.routing import verl_setting
    from areal_plugins.config.settings import ArealConfig

    if not OmegaConf.has_resolver("areal_package_path"):
        root = Path(__file__).resolve().parent
        OmegaConf.register_new_resolver("areal_package_path", lambda rel: str(root / rel))
    if not OmegaConf.has_resolver("areal_verl"):

        def areal_verl(name: str, node: object) -> object:
            return verl_setting(name, ArealConfig.from_node(node))

        OmegaConf.register_new_resolver("areal_verl", areal_verl)


try:
    register_with_verl()
except Exception:  # verl would swallow it silently
    logger.exception("areal_plugins failed to register with verl")
    raise
