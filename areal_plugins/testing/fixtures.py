"""The pytest fixtures for plugin authors (``pytest_plugins = ["areal_plugins.testing"]`` loads them) and the
context manager behind them: a plugin registered for one test, validated like an installed one, then unregistered."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pluggy
import pytest

from areal_plugins.plugin_manager import check_plugins, get_plugin_manager


@contextmanager
def plugin_registered(
    plugin: Any, manager: pluggy.PluginManager | None = None, name: str | None = None
) -> Iterator[Any]:
    """Register ``plugin`` (validated like an installed one) for the ``with`` block, then unregister it."""
    manager = manager or get_plugin_manager()
    registered_name = manager.register(plugin, name=name)
    try:
        check_plugins(manager)
        yield plugin
    finally:
        manager.unregister(name=registered_name)


@pytest.fixture
def areal_plugin_manager() -> pluggy.PluginManager:
    """The process-wide plugin manager."""
    return get_plugin_manager()


@pytest.fixture
def registered_plugin(areal_plugin_manager: pluggy.PluginManager) -> Any:
    """A context manager factory: ``with registered_plugin(obj): ...`` registers ``obj`` for the block."""

    def register(plugin: Any, name: str | None = None) -> Any:
        return plugin_registered(plugin, areal_plugin_manager, name)

    return register
