"""Loaded by verl in every process (entry point group ``verl.plugins``), Ray workers included.

It only registers: the CPU platform, our rollout backend ``areal_cpu`` and checked vLLM adapter, our
``areal_gloo`` checkpoint engine and the checksums of verl's ``nccl`` (weight_sync/checked_transfer.py), the
``areal_decoupled`` policy losses, the ``areal_*`` trainer modes, config resolvers and, when this process
runs verl on the CPU platform (``VERL_PLATFORM=cpu``), the patches verl needs there. verl logs a
plugin's load failure at debug level only, so failures here are logged as errors instead.
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger("areal_plugins")

#: Set in every process where registration succeeded, so that tests and the CLI can check it.
LOADED = False


def register_with_verl() -> None:
    """Register our platform and rollout backend; prepare CPU-only runs. Idempotent."""
    global LOADED
    from areal_plugins._compat import UnsupportedVerlVersionError, check_verl_version

    try:
        check_verl_version()
    except UnsupportedVerlVersionError as error:
        logger.error("areal_plugins disabled: %s", error)
        return
    from areal_plugins.platforms.cpu import cpu_platform_selected, register_cpu_platform
    from areal_plugins.rollout.verl_registration import register_rollout_backends
    from areal_plugins.trainers import register_trainers
    from areal_plugins.trainers.policy_loss import register_policy_loss_with_verl
    from areal_plugins.weight_sync.checked_transfer import register_checked_checkpoint_engines
    from areal_plugins.weight_sync.gloo import register_gloo_checkpoint_engine

    register_cpu_platform()
    register_rollout_backends()
    register_policy_loss_with_verl()
    register_trainers()
    register_gloo_checkpoint_engine()
    register_checked_checkpoint_engines()
    _register_config_resolvers()
    if cpu_platform_selected():
        # verl's FSDP engine is registered for cuda/npu only; its code is device-agnostic
        # through the platform, so look it up under "cuda" (verl's own override knob).
        os.environ.setdefault("VERL_ENGINE_DEVICE", "cuda")
    from areal_plugins.patches import apply_enabled_patches

    apply_enabled_patches()
    LOADED = True


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
