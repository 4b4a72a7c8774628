"""Import paths that moved: each old module forwards its names to their new place, with a ``DeprecationWarning``.

A plugin written against an earlier layout keeps loading for at least one release after a move: the plugin API holds
still (``CHANGELOG.md`` says what moved and where). Each old module is a file at its old path whose whole body is
``def __getattr__(name): return forward(__name__, name)`` (PEP 562); :data:`MOVED` is the one list of them. The new
module is imported by name when an old path is first asked for a name, so a forwarding module ties no folder to
another in the import graph (``tests/unit/test_architecture.py``): it holds no code of its own.
``tests/unit/test_plugin_api.py`` imports every name the docs showed at an old path and checks the warning.

A name renamed in its own module is answered the same way: :data:`RENAMED` lists it, and the module's ``__getattr__``
calls :func:`renamed`; a renamed keyword argument is accepted by :func:`renamed_keywords`.
"""

from __future__ import annotations

import functools
import importlib
import warnings
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

P = ParamSpec("P")
R = TypeVar("R")

#: Old module -> the module its names live in now (moved in 0.1.0's layout by process, before its release).
MOVED: dict[str, str] = {
    "areal_plugins.trainers.admission": "areal_plugins.driver.admission",
    "areal_plugins.trainers.settled_groups": "areal_plugins.actors.settled_groups",
    "areal_plugins.hooks.manager": "areal_plugins.plugin_manager",
}

#: ``(module, old name)`` -> the name the same object has in that module now (the staleness controller's contract was
#: ``AdmissionCounters``, renamed in 0.1.0 so the controller has one name: ``StalenessController``, its contract
#: ``StalenessControllerLike``, a manager's ``staleness_controller``).
RENAMED: dict[tuple[str, str], str] = {
    ("areal_plugins", "AdmissionCounters"): "StalenessControllerLike",
    ("areal_plugins.hooks.contracts", "AdmissionCounters"): "StalenessControllerLike",
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


def renamed(module: str, name: str) -> Any:
    """What ``module`` answers for ``name`` when it is not defined there (its module-level ``__getattr__``, PEP 562):
    the object under its new name (:data:`RENAMED`), with a ``DeprecationWarning`` that names it."""
    new = RENAMED.get((module, name))
    if new is None:
        raise AttributeError(f"module {module!r} has no attribute {name!r}")
    warnings.warn(
        f"{module}.{name} is deprecated: it is called {new} now (import {new} from {module}); the old name will be "
        "removed in a later release",
        DeprecationWarning,
        stacklevel=3,  # the line that asked for it: renamed <- the module's __getattr__ <- that line
    )
    return getattr(importlib.import_module(module), new)


def renamed_keywords(**old_to_new: str) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """Let the decorated function take each keyword ``old`` under its new name ``old_to_new[old]`` too, with a
    ``DeprecationWarning`` (a caller written before the rename keeps working for at least one release)."""

    def decorate(function: Callable[P, R]) -> Callable[P, R]:
        where = function.__qualname__.removesuffix(".__init__")  # a class's constructor: the class's name

        @functools.wraps(function)
        def accept_old_keywords(*args: P.args, **kwargs: P.kwargs) -> R:
            for old, new in old_to_new.items():
                if old not in kwargs:
                    continue
                if new in kwargs:
                    raise TypeError(f"{where}() got both {new}= and its deprecated name {old}=")
                warnings.warn(
                    f"{where}({old}=...) is deprecated: pass {new}=...; the old keyword will be "
                    "removed in a later release",
                    DeprecationWarning,
                    stacklevel=2,
                )
                kwargs[new] = kwargs.pop(old)
            return function(*args, **kwargs)

        return accept_old_keywords

    return decorate
