"""Version-guarded patches of verl, applied only for the features that need them.

Seams first: everything verl lets us register (platform, rollout backend, policy loss, trainer)
is registered, not patched. A module here exists only where verl 0.9.1 has no seam; each says
why, where upstream stands and when to delete it.
"""

from __future__ import annotations

from types import ModuleType

from areal_plugins.patches import gloo_backend

#: Patches that running verl on the CPU platform needs, in the order they are applied.
CPU_PATCHES: tuple[ModuleType, ...] = (gloo_backend,)


def apply_cpu_patches() -> None:
    """Apply the patches that make verl run on the CPU platform."""
    for patch in CPU_PATCHES:
        patch.apply()


def revert_all() -> None:
    """Revert every applied patch, in reverse order."""
    for patch in reversed(CPU_PATCHES):
        patch.revert()
