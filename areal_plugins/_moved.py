"""Import paths that moved: each old module forwards its names to their new place, with a ``DeprecationWarning``.

A plugin written against an earlier layout keeps loading for at least one release after a move: the plugin API holds
still (``CHANGELOG.md`` says what moved and where). Each old module is a file at its old path whose whole body is
``def __getattr__(name): return forward(__name__, name)`` (PEP 562); :data:`MOVED` is the one list of them. The new
module is imported by name when an old path is first asked for a name, so a forwarding module ties no folder to
another in the import graph (``tests/unit/test_architecture.py``): it holds no code of its own.
``tests/unit/test_plugin_api.py`` imports every name the docs showed at an old path and checks the warning.
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any

#: Old module -> the module its names live in now (moved in 0.1.0's layout by process, before its release).
MOVED: dict[str, str] = {
    "areal_plugins.trainers.admission": "areal_plugins.driver.admission",
    "areal_plugins.trainers.settled_groups": "areal_plugins.actors.settled_groups",
    "areal_plugins.hooks.manager": "areal_plugins.plugin_manager",
}


def forward(old: str, name: str) -> Any:
    """What the old module ``old`` answers for ``name`` (its module-level ``__getattr__``, PEP 562): the object at its
    new place, with a ``DeprecationWarning`` that names the place to import it from."""
    new = MOVED[old]
    if name.startswith("__"):  # the import system's probes (__path__, __file__, ...) stay the old module's
        raise AttributeError(f"module {old!r} has no attribute {name!r}")
    target = importlib.import_module(new)
    if not hasattr(target, name):
        raise AttributeError(f"module {old!r} has no attribute {name!r} (its names moved to {new})")
    if name in importlib.import_module("areal_plugins").__all__:
        advice = f"import {name} from areal_plugins (the plugin API; it lives in {new})"
    else:
        advice = f"import {name} from {new}"
    warnings.warn(
        f"{old} is deprecated: {advice}; the old path will be removed in a later release",
        DeprecationWarning,
        stacklevel=3,  # the line that imported it: forward <- the old module's __getattr__ <- that line
    )
    return getattr(target, name)
