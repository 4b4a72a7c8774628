"""Deprecated: moved to :mod:`areal_plugins.plugin_manager`; import ``call_hook``, ``Hooks``, ``build_plugin_manager``
and ``PluginError`` from :mod:`areal_plugins`."""

from __future__ import annotations

from typing import Any

from areal_plugins._moved import forward


def __getattr__(name: str) -> Any:
    return forward(__name__, name)
