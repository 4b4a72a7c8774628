"""Version-guarded patches of verl, applied only for the features that need them.

Seams first: everything verl lets us register (platform, rollout backend, policy loss, trainer,
sampler, LLM client) is registered, not patched. A module here exists only where verl 0.9.1 has
no seam; each says why, where upstream stands and when to delete it.

``apply_enabled_patches(config)`` is the one entry point: it walks :data:`PATCHES` in order and
applies each patch whose feature is enabled. Today the only patch belongs to the CPU platform
(selected by ``VERL_PLATFORM=cpu``); no ``areal:`` feature needs a patch, so ``areal.enable:
false`` on a GPU machine patches nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

from areal_plugins.patches import gloo_backend


def _cpu_platform(config: Any) -> bool:
    from areal_plugins.cpu.platform import cpu_platform_selected

    return cpu_platform_selected()


#: (feature, is it enabled for this run?, patch), in the order they are applied.
PATCHES: tuple[tuple[str, Callable[[Any], bool], ModuleType], ...] = (
    ("cpu platform (VERL_PLATFORM=cpu)", _cpu_platform, gloo_backend),
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


def applied_patches() -> list[str]:
    """Names of the patches applied in this process."""
    return [patch.__name__ for _, _, patch in PATCHES if patch.is_applied()]


def revert_all() -> None:
    """Revert every applied patch, in reverse order."""
    for _, _, patch in reversed(PATCHES):
        patch.revert()
