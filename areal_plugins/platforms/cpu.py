"""A CPU platform for verl, registered through ``verl.plugin.platform.PlatformRegistry``.

verl 0.9.1 registers CUDA, NPU and ROCm only; with none of them present it falls back to CUDA and
fails. This platform is selected by ``VERL_PLATFORM=cpu`` (our CLI sets it when the recipe's
``trainer.device`` is ``cpu``). Ray still schedules verl's workers on a ``GPU`` resource, so the recipe
declares one fake GPU per trainer process (``ray_kwargs.ray_init.num_gpus``) — no CUDA code runs.
"""

from __future__ import annotations

PLATFORM_NAME = "cpu"


def build_platform_class() -> type:
    """The platform class (platforms/cpu_platform.py); imported here, on registration, so that importing this module
    needs no verl."""
    from areal_plugins.platforms.cpu_platform import PlatformCPU

    return PlatformCPU


def register_cpu_platform() -> None:
    """Register the CPU platform under the name ``cpu`` (idempotent)."""
    from verl.plugin.platform import PlatformRegistry

    if PlatformRegistry.get(PLATFORM_NAME) is None:
        PlatformRegistry.register(platform=PLATFORM_NAME)(build_platform_class())


def cpu_platform_selected() -> bool:
    """True when this process runs verl on our CPU platform."""
    import os

    return os.environ.get("VERL_PLATFORM", "").strip().lower() == PLATFORM_NAME
