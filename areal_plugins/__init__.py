"""areal_plugins: asynchronous RL for verl, the AReaL way.

The plugin API is what this module exports (``__all__``): the ``hookimpl`` marker, the contracts a plugin's objects
meet, the trajectory and buffered-group types hooks receive, ``Hooks`` (every hook as a typed method: what the package
and a plugin's tests call; ``call_hook`` calls one by name) and the error a failing plugin raises. Everything else is
internal: the folders say which process runs it (``CONTRIBUTING.md``, "Where code runs").

Importing this package imports neither verl nor Ray; verl loads ``areal_plugins.verl_plugin``
through its ``verl.plugins`` entry point.
"""

from __future__ import annotations

from areal_plugins.core.buffer import BufferedGroup
from areal_plugins.core.trajectory import Trajectory
from areal_plugins.hooks.contracts import (
    AdmissionCounters,
    BackendCapabilities,
    PolicyLoss,
    RewardFunction,
    RolloutManager,
    SampleBuffer,
)
from areal_plugins.hooks.hookimpl import hookimpl
from areal_plugins.plugin_manager import Hooks, PluginError, call_hook

__version__ = "0.1.0"
__all__ = [
    "AdmissionCounters",
    "BackendCapabilities",
    "BufferedGroup",
    "Hooks",
    "PluginError",
    "PolicyLoss",
    "RewardFunction",
    "RolloutManager",
    "SampleBuffer",
    "Trajectory",
    "__version__",
    "call_hook",
    "hookimpl",
]
