"""areal_plugins: asynchronous RL for verl, the AReaL way.

Importing this package imports neither verl nor Ray; verl loads ``areal_plugins.verl_plugin``
through its ``verl.plugins`` entry point.
"""

from __future__ import annotations

from areal_plugins.hooks.hookimpl import hookimpl

__version__ = "0.1.0"
__all__ = ["__version__", "hookimpl"]
