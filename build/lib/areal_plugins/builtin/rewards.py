"""Default reward: exact answers through math-verify."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from areal_plugins.hooks.hookimpl import hookimpl


@hookimpl(trylast=True)
def areal_make_reward_fn(config: Any) -> Callable[..., float]:
    from areal_plugins.rewards.math_verify_reward import compute_score

    return compute_score
