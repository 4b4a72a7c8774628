"""Run a function inside every process of verl's Ray worker groups (the trainer's workers).

verl's worker processes load our plugin without the recipe; what the recipe chose (plugin set,
patches) reaches them from the driver this way, on whichever node they run, instead of through the
driver's environment (which a worker on another node never sees).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def run_in_workers(worker_groups: list[Any], function: Callable[..., Any], *args: Any) -> list[Any]:
    """Call ``function(*args)`` once in each distinct worker actor of ``worker_groups``; their results."""
    import ray

    handles = {id(handle): handle for group in worker_groups for handle in group.workers}
    return ray.get([handle.__ray_call__.remote(_call, function, *args) for handle in handles.values()])


def _call(_actor: Any, function: Callable[..., Any], *args: Any) -> Any:
    return function(*args)


def apply_patches_in_workers(config: Any, worker_groups: list[Any]) -> list[str]:
    """Apply the run's enabled patches inside every process of ``worker_groups`` (verl Ray worker groups).

    Worker processes load our plugin without the recipe, so features chosen in the recipe reach them from the driver.
    """
    from areal_plugins.patches import apply_by_name, enabled_patches

    names = [patch.__name__ for patch in enabled_patches(config)]
    if names:
        run_in_workers(worker_groups, apply_by_name, names)
    return names
