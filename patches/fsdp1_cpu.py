"""Patch: verl's FSDP1 engine (``strategy: fsdp``, verl's default) on the CPU platform.

*Why*: two spots of verl 0.9.1's FSDP1 path assume an accelerator, and neither has a setting:

- verl builds FSDP1 with ``sync_module_states=True`` (``_build_fsdp_module`` in
  ``verl/workers/engine/fsdp/transformer_impl.py``: rank 0's weights are broadcast to the ranks that built theirs on
  the meta device), and torch refuses that for a module whose tensors are on the CPU ("The module has CPU parameters
  or buffers when `sync_module_states=True`") before it broadcasts, because NCCL cannot broadcast CPU tensors. On the
  CPU platform the process group is gloo (``gloo_backend``), which can: the replacement skips torch's check where the
  default process group's backend is gloo and keeps it otherwise; the broadcast itself is torch's, unchanged.
- before it exports the weights for the engines, verl moves FSDP1's flat parameters to
  ``f"{get_device_name()}:{get_device_id()}"`` (``load_fsdp_model_to_gpu`` in ``verl/utils/fsdp_utils.py``), which on
  the CPU platform is ``"cpu:cpu"``, not a device torch knows. There the CPU is the device FSDP1 computes on and its
  flat parameters are on it already: the replacement leaves them where they are; FSDP2 modules and every other device
  go to verl's function.

FSDP2 (``strategy: fsdp2``) loads the full state dict instead of broadcasting, moves its modules with ``.to(device)``
and runs on the CPU as verl ships it.
*Upstream*: no seam exists (torch 2.13 ``torch/distributed/fsdp/_init_utils.py``; verl 0.9.1 hard-codes
``sync_module_states=True`` and builds the device string itself). *Remove when*: torch checks the process group's
backend instead of the tensors' device, and verl builds FSDP1's device from the platform; no upstream issue yet:
watch ``torch/distributed/fsdp/_init_utils.py`` and verl's ``verl/utils/fsdp_utils.py``.

Applied at plugin load in every process on the CPU platform (``VERL_PLATFORM=cpu``), with the other CPU patches.
verl's engine module imports ``load_fsdp_model_to_gpu`` by name when the trainer builds its engine, after the plugin
load, so it binds the replacement.
"""

from __future__ import annotations

import functools
from typing import Any

from areal_plugins.patches._base import AttributePatch

from areal_plugins._compat import SUPPORTED_VERL

#: torch's check (called by name from ``_sync_module_params_and_buffers`` in the same module), and verl's staging of
#: FSDP1's flat parameters on the device.
TARGETS = (
    ("torch.distributed.fsdp._init_utils", "_check_module_states_for_sync_module_states"),
    ("verl.utils.fsdp_utils", "load_fsdp_model_to_gpu"),
)


def _gloo_group() -> bool:
    import torch.distributed as dist

    return bool(dist.is_available() and dist.is_initialized() and dist.get_backend() == "gloo")


def _fsdp1_on_cpu(model: Any) -> bool:
    from verl.utils.device import get_device_name
    from verl.utils.fsdp_utils import fsdp_version

    return get_device_name() == "cpu" and fsdp_version(model) == 1


def _make_replacement(original: Any) -> Any:
    if original.__name__ == "load_fsdp_model_to_gpu":

        @functools.wraps(original)
        def load_fsdp_model_to_gpu(model: Any) -> None:
            if _fsdp1_on_cpu(model):  # the CPU is FSDP1's compute device here: its flat parameters are on it
                return
            original(model)

        return load_fsdp_model_to_gpu

    @functools.wraps(original)
    def _check_module_states_for_sync_module_states(module_states: Any) -> None:
        if _gloo_group():  # gloo broadcasts CPU tensors: nothing to refuse
            return
        original(module_states)

    return _check_module_states_for_sync_module_states


PATCH = AttributePatch("fsdp1_cpu", TARGETS, _make_replacement, SUPPORTED_VERL)
apply = PATCH.apply
revert = PATCH.revert
is_applied = PATCH.is_applied
