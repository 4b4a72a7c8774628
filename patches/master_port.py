"""Patch: pick the trainer's torch.distributed port outside the kernel's ephemeral range.

*Why*: verl picks ``MASTER_PORT`` by binding port 0 in a Ray task and letting it go; the trainer's process binds
it again seconds later, once its worker processes have started. Port 0 draws from the ephemeral range, the same
range every outbound connection on the node draws from (Ray's own connections included), so on a busy node one
of them can take the port in between and the run dies at startup with ``EADDRINUSE`` (seen in CI, where many
processes start on two cores). A port below the ephemeral range is never handed out to a connection.
*How*: the same Ray task, on the same node, tries random ports between 20000 (above Ray's worker ports,
10002-19999) and the start of the node's ephemeral range until one binds; when none does, or when the caller
passed a ``master_port_range`` of its own, verl's original choice is kept.
Applied with the CPU platform only (``VERL_PLATFORM=cpu``), in every process, before verl creates its workers.
*Upstream*: no seam (verl 0.9.1 ``verl/single_controller/ray/base.py``, ``get_master_addr_port``; the worker
group's ``master_port_range`` is not reachable from a recipe).
*Remove when*: verl binds the port it hands out until the trainer takes it, or exposes ``master_port_range``;
watch verl issues #3147 and #5889 (open: a worker's ``init_process_group`` fails with ``EADDRINUSE``).
"""

from __future__ import annotations

from typing import Any

from areal_plugins.patches._base import AttributePatch

from areal_plugins._compat import SUPPORTED_VERL
from areal_plugins.platforms.ports import LOWEST_PORT, ephemeral_range, port_outside_ephemeral_range

MODULE = "verl.single_controller.ray.base"
__all__ = ["LOWEST_PORT", "MODULE", "apply", "ephemeral_range", "is_applied", "port_outside_ephemeral_range", "revert"]


def _replacement(original: Any) -> Any:
    import ray

    original_function = original._function  # the plain function behind verl's @ray.remote

    @ray.remote
    def get_master_addr_port(master_port_range: list[int] | None = None) -> tuple[str, str]:
        if master_port_range is None:
            port = port_outside_ephemeral_range(LOWEST_PORT, ephemeral_range()[0])
            if port is not None:
                return ray.util.get_node_ip_address().strip("[]"), str(port)
        return original_function(master_port_range)

    return get_master_addr_port


PATCH = AttributePatch("master_port", ((MODULE, "get_master_addr_port"),), _replacement, SUPPORTED_VERL)
apply = PATCH.apply
revert = PATCH.revert
is_applied = PATCH.is_applied
