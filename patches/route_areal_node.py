"""Patch: route ``areal.enable: true`` in any verl recipe, not only in recipes that include our config group.

*Why*: our routing of verl's keys (trainer mode, policy loss, rollout correction) lives in the Hydra
config group ``areal: default``; a verl user who writes ``areal: {enable: true}`` into their own recipe,
or passes ``+areal.enable=true`` to ``verl.trainer.main_ppo``, gets a config without it, and verl then
silently runs its own trainer. verl has no hook between composing the config and starting the run,
except ``validate_config``, which ``main_ppo`` calls on the composed config in the driver before Ray
starts. Wrapping it routes the config there (:func:`areal_plugins.config.routing.route_composed_config`) or
stops with the key to change.
*Upstream*: no seam exists (verl 0.9.1 ``verl/trainer/main_ppo.py`` calls ``validate_config`` directly).
*Remove when*: verl offers a config-transform hook or an entry point for config groups of plugins; no upstream
issue yet: watch ``verl/trainer/main_ppo.py``.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

from areal_plugins.patches._base import AttributePatch

from areal_plugins._compat import SUPPORTED_VERL

logger = logging.getLogger(__name__)

#: ``main_ppo`` binds the name when it is imported, after ``import verl`` loaded our plugin.
TARGETS = (("verl.utils.config", "validate_config"),)


def _make_replacement(original: Any) -> Any:
    @functools.wraps(original)
    def validate_config(config: Any, *args: Any, **kwargs: Any) -> Any:
        from areal_plugins.config.routing import route_composed_config

        changes = route_composed_config(config)
        if changes:
            logger.warning(
                "areal_plugins: areal.enable=true routed %s", ", ".join(f"{k}={v!r}" for k, v in changes.items())
            )
        return original(config, *args, **kwargs)

    return validate_config


PATCH = AttributePatch("route_areal_node", TARGETS, _make_replacement, SUPPORTED_VERL)
apply = PATCH.apply
revert = PATCH.revert
is_applied = PATCH.is_applied
