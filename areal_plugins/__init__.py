"""areal_plugins: asynchronous RL for verl, the AReaL way.

The plugin API is what this module exports (``__all__``): the ``hookimpl`` marker, the contracts a plugin's objects
meet, the trajectory and buffered-group types hooks receive, ``Hooks`` (every hook as a typed method: what the package
and a plugin's tests call; ``call_hook`` calls one by name), ``build_plugin_manager`` and the error a failing plugin
raises; and what a replacement rollout manager builds on (the default's ``AdmissionLoop`` and ``StalenessController``,
the settings ``ArealConfig``, the settled-groups inbox ``start_inbox``/``drain_reports``). Every name the docs show a
plugin importing comes from here (or, for its tests, :mod:`areal_plugins.testing`), and stays: a name that moves inside
the package keeps its old import path for at least one release, with a ``DeprecationWarning`` (:mod:`._moved`).
Everything else is internal: the folders say which process runs it (``CONTRIBUTING.md``, "Where code runs").

Importing this package imports neither verl nor Ray; verl loads ``areal_plugins.verl_plugin``
through its ``verl.plugins`` entry point.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from areal_plugins._moved import renamed
from areal_plugins.actors.settled_groups import SettledReport, drain_reports, start_inbox
from areal_plugins.config.settings import ArealConfig
from areal_plugins.core.buffer import BufferedGroup
from areal_plugins.core.staleness import StalenessController
from areal_plugins.core.trajectory import Trajectory
from areal_plugins.driver.admission import AdmissionLoop
from areal_plugins.hooks.contracts import (
    BackendCapabilities,
    PolicyLoss,
    RewardFunction,
    RolloutManager,
    SampleBuffer,
    StalenessControllerLike,
)
from areal_plugins.hooks.hookimpl import hookimpl
from areal_plugins.plugin_manager import Hooks, PluginError, build_plugin_manager, call_hook

__version__ = "0.1.0"
__all__ = [
    "AdmissionLoop",
    "ArealConfig",
    "BackendCapabilities",
    "BufferedGroup",
    "Hooks",
    "PluginError",
    "PolicyLoss",
    "RewardFunction",
    "RolloutManager",
    "SampleBuffer",
    "SettledReport",
    "StalenessController",
    "StalenessControllerLike",
    "Trajectory",
    "__version__",
    "build_plugin_manager",
    "call_hook",
    "drain_reports",
    "hookimpl",
    "start_inbox",
]


if not TYPE_CHECKING:  # type checkers see the alias below, without a __getattr__ that would make any name pass

    def __getattr__(name: str) -> Any:
        return renamed(__name__, name)  # AdmissionCounters, with a DeprecationWarning (_moved.RENAMED)

else:
    AdmissionCounters = StalenessControllerLike  # deprecated: StalenessControllerLike
