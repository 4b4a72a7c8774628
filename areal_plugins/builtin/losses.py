"""Default policy loss: the decoupled PPO objective."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from areal_plugins.hooks.hookimpl import hookimpl


@hookimpl(trylast=True)
def areal_make_policy_loss() -> Callable[..., Any]:
    from areal_plugins.core.losses import decoupled_ppo_loss

    return decoupled_ppo_loss
