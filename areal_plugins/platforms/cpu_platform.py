"""``PlatformCPU``: verl's platform for CPU-only machines (registered by :mod:`.cpu` as ``cpu``).

This module imports verl's platform base at its top, so only the registration imports it, once verl has imported
its platform registry: loading the plugin stays light.
"""

from __future__ import annotations

import types
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from verl.plugin.platform.platform_base import PlatformBase


def _make_device_module() -> types.ModuleType:
    """``torch.cpu`` plus the ``torch.cuda``-style calls verl makes on its device module."""
    module = types.ModuleType("areal_cpu_device")
    for name in dir(torch.cpu):
        if not name.startswith("_"):
            setattr(module, name, getattr(torch.cpu, name))
    module.__dict__.update(
        get_device_name=lambda *args, **kwargs: "CPU",  # the flops counter looks up peak flops by name
        manual_seed=torch.manual_seed,
        manual_seed_all=torch.manual_seed,
        # verl's checkpoint restores "the device RNG" under the device name, which is "cpu" here.
        get_rng_state=torch.get_rng_state,
        set_rng_state=torch.set_rng_state,
        empty_cache=lambda: None,
        memory_allocated=lambda *args, **kwargs: 0,
        memory_reserved=lambda *args, **kwargs: 0,
        max_memory_allocated=lambda *args, **kwargs: 0,
        max_memory_reserved=lambda *args, **kwargs: 0,
        reset_peak_memory_stats=lambda *args, **kwargs: None,
        mem_get_info=_mem_get_info,
        current_device=lambda: "cpu",  # torch.device(...) and .to(...) accept the string
        is_available=lambda: True,
        device_count=lambda: 1,
    )
    return module


def _mem_get_info(*args: Any, **kwargs: Any) -> tuple[int, int]:
    import psutil

    memory = psutil.virtual_memory()
    return memory.available, memory.total


#: ``torch.cpu`` with the ``torch.cuda``-style calls verl makes, the platform's device module.
DEVICE_MODULE = _make_device_module()


class PlatformCPU(PlatformBase):
    """verl platform for CPU-only machines: device ``cpu``, collectives over gloo."""

    @property
    def device_name(self) -> str:
        return "cpu"

    @property
    def vendor_name(self) -> str:
        return "cpu"

    @property
    def device_module(self) -> types.ModuleType:
        return DEVICE_MODULE

    def is_available(self) -> bool:
        return True

    def is_platform_available(self, use_smi_check: bool = False) -> bool:
        # Never auto-detected: VERL_PLATFORM=cpu selects it explicitly.
        return False

    def current_device(self) -> Any:
        return "cpu"

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index: int) -> None:
        return None

    def synchronize(self, device_index: int | None = None) -> None:
        return None

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        return None

    def empty_cache(self) -> None:
        return None

    def get_device_capability(self, device_index: int = 0) -> tuple[int | None, int | None]:
        return None, None

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        return "CUDA_VISIBLE_DEVICES"

    @contextmanager
    def nvtx_range(self, msg: str) -> Iterator[None]:
        yield

    def profiler_start(self) -> None:
        return None

    def profiler_stop(self) -> None:
        return None

    def ray_resource_name(self) -> str:
        return "GPU"

    def ray_noset_envvars(self) -> list[str]:
        return []

    def is_ipc_supported(self) -> bool:
        return False

    def cudart(self) -> Any:
        return None
