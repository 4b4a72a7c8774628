"""verl's ``custom_reward_function`` entry that asks the ``areal_make_reward_fn`` hook for the reward.

Recipes point ``reward.custom_reward_function`` here and pass the ``areal:`` switch and plugin
selection through ``reward_kwargs`` (verl's own seam for arguments of a custom reward), so the reward
worker processes load the same plugin set as the driver. With ``areal_enable: false`` no hook is
called: the math-verify reward is used directly.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from areal_plugins.rewards.math_verify_reward import compute_score as math_verify_score

_lock = threading.Lock()
_chosen: dict[tuple, Callable[..., float]] = {}


def _reward_fn(enable: bool, plugins: dict[str, Any]) -> Callable[..., float]:
    include = plugins.get("include")
    exclude = list(plugins.get("exclude") or [])
    key = (enable, tuple(include) if include is not None else None, tuple(exclude))
    with _lock:
        if key not in _chosen:
            if not enable:
                _chosen[key] = math_verify_score
            else:
                from areal_plugins.manager import call_hook, configure_plugins

                if include is not None or exclude:  # the default set needs no rebuild
                    configure_plugins(include=include, exclude=exclude)
                settings = {"areal": {"enable": enable, "plugins": dict(plugins)}}
                _chosen[key] = call_hook("areal_make_reward_fn", config=settings)
        return _chosen[key]


def compute_score(
    data_source: str,
    solution_str: str,
    ground_truth: str,
    extra_info: dict[str, Any] | None = None,
    areal_enable: bool = False,
    areal_plugins: dict[str, Any] | None = None,
    **kwargs: Any,
) -> float:
    """The reward of ``solution_str`` from the hook-chosen function (math-verify by default)."""
    fn = _reward_fn(bool(areal_enable), dict(areal_plugins or {}))
    return float(fn(data_source, solution_str, ground_truth, extra_info))
