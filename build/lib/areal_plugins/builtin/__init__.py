"""Built-in features as ordinary plugins, registered ``trylast`` so a third party always wins."""

from __future__ import annotations

from areal_plugins.builtin import async_rollout, losses, rewards, validation

BUILTIN_PLUGINS = (
    ("areal_plugins.builtin.rewards", rewards),
    ("areal_plugins.builtin.losses", losses),
    ("areal_plugins.builtin.async_rollout", async_rollout),
    ("areal_plugins.builtin.validation", validation),
)
