"""For plugin authors: fixtures that register a plugin for one test, and the conformance kit.

The conformance kit checks an implementation of a contract of :mod:`areal_plugins.hooks.contracts` by its
behaviour: :func:`check_sample_buffer` and :func:`check_rollout_manager` (which drives a manager against
:class:`InMemoryTransferQueue`, a stand-in for verl's TransferQueue). Each raises
:class:`ContractViolationError` naming the broken rule.

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

from areal_plugins.plugin_manager import check_plugins, get_plugin_manager
from areal_plugins.testing.buffer_kit import check_sample_buffer
from areal_plugins.testing.manager_kit import ManagerKit, check_rollout_manager
from areal_plugins.testing.memory_transfer_queue import InMemoryTransferQueue
from areal_plugins.testing.violations import ContractViolationError

__all__ = [
    "ContractViolationError",
    "InMemoryTransferQueue",
    "ManagerKit",
    "areal_plugin_manager",
    "check_rollout_manager",
    "check_sample_buffer",
    "plugin_registered",
    "registered_plugin",
]


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
