"""Fixtures for plugin authors: register a plugin for one test and always remove it after.

Use in a ``conftest.py``::

    pytest_plugins = ["areal_plugins.testing"]

    def test_my_filter(areal_plugin_manager, registered_plugin):
        with registered_plugin(MyPlugin()):
            ...
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pluggy
import pytest

from areal_plugins.hooks.manager import check_plugins, get_plugin_manager


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
