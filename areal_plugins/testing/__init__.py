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

The names are imported on first use, so a process that imports only :mod:`areal_plugins.testing.faults` (the tests'
fault plan, which the engines and trainer workers ask) pulls in neither pytest nor the kit.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from areal_plugins.testing.buffer_kit import check_sample_buffer
    from areal_plugins.testing.fixtures import areal_plugin_manager, plugin_registered, registered_plugin
    from areal_plugins.testing.manager_kit import ManagerKit, check_rollout_manager
    from areal_plugins.testing.memory_transfer_queue import InMemoryTransferQueue
    from areal_plugins.testing.violations import ContractViolationError

#: Each exported name, by the module that defines it.
_HOMES = {
    "ContractViolationError": "violations",
    "InMemoryTransferQueue": "memory_transfer_queue",
    "ManagerKit": "manager_kit",
    "areal_plugin_manager": "fixtures",
    "check_rollout_manager": "manager_kit",
    "check_sample_buffer": "buffer_kit",
    "plugin_registered": "fixtures",
    "registered_plugin": "fixtures",
}

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


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    # pytest finds a plugin module's fixtures by dir() (``pytest_plugins = ["areal_plugins.testing"]``).
    return sorted({*globals(), *__all__})
