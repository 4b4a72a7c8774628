"""Patch: initialise verl's process group with plain ``gloo`` on the CPU platform.

*Why*: verl builds the backend string ``f"cpu:gloo,{device}:{backend}"``; on CPU that is
``"cpu:gloo,cpu:gloo"``, which torch rejects ("Duplicate device type cpu"). No config or platform
hook controls the string, so the CPU platform cannot avoid it.
*Upstream*: no seam exists (verl 0.9.1 ``verl/utils/distributed.py``).
*Remove when*: verl de-duplicates the device types in that string or lets the platform give it; watch verl issue #6237
(open: torch rejects verl's ``cpu:gloo,cpu:nccl``, the same string built where verl's device is the CPU, with
"Duplicate device type cpu"; its fix may instead refuse a missing GPU, so check which) and
``verl/utils/distributed.py`` (verl PR #7512, merged, had ``initialize_global_process_group`` build the same
``cpu:gloo,<device>:<backend>`` string as the Ray initializer patched here).
"""

from __future__ import annotations

import functools
from typing import Any

from areal_plugins.patches._base import AttributePatch

from areal_plugins._compat import SUPPORTED_VERL

#: ``engine_workers`` imported the function by name, so its copy is patched too.
TARGETS = (
    ("verl.utils.distributed", "initialize_global_process_group_ray"),
    ("verl.workers.engine_workers", "initialize_global_process_group_ray"),
)
#: Not imported by ``apply()`` (at plugin load, in every process on the CPU platform: it pulls in verl's checkpoint
#: engines and distillation trainer, about 2 s): patched when verl imports it, binding the patched function by name.
ON_IMPORT = frozenset({"verl.workers.engine_workers"})


def _make_replacement(original: Any) -> Any:
    @functools.wraps(original)
    def initialize_global_process_group_ray(timeout_second: Any = None, backend: str | None = None) -> Any:
        return original(timeout_second=timeout_second, backend=backend or "gloo")

    return initialize_global_process_group_ray


PATCH = AttributePatch("gloo_backend", TARGETS, _make_replacement, SUPPORTED_VERL, on_import=ON_IMPORT)
apply = PATCH.apply
revert = PATCH.revert
is_applied = PATCH.is_applied
