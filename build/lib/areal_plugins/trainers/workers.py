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
