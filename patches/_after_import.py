"""A post-import hook: run code the moment a module has been imported, without importing it ourselves.

verl's registries and some of our patches' targets live in modules that ``import verl`` does not load; importing
them to register a name or patch a function would make every verl process pay for them. :class:`AfterImport` (one
per process, first on :data:`sys.meta_path`: :func:`installed`) finds nothing itself: for a watched name it asks
the other finders and wraps the loader they return, so that what waits for the module runs right after the module's
code has run, before the import returns to whoever asked for it and so before anyone can use the module. A module
imported already is served at once.

Used by :mod:`areal_plugins.verl_plugin` (its registrations) and by
:class:`~areal_plugins.patches._base.AttributePatch` (targets patched once imported); a watcher of its own (the
benchmarks' record of verl's token versions) wraps loaders with :func:`spec_running_after`. It imports nothing of the
package, so that all of them can import it.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import logging
import sys
import threading
import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any

logger = logging.getLogger("areal_plugins")

#: What waits for a module: ``"module:function"`` (imported and called) or a callable taking no argument.
Target = str | Callable[[], None]

_INSTALL_LOCK = threading.Lock()


def _call(target: Target) -> None:
    if callable(target):
        target()
        return
    module, _, name = target.partition(":")
    getattr(importlib.import_module(module), name)()


def describe(target: Target) -> str:
    """``target`` as a line of a log or a listing."""
    return target if isinstance(target, str) else repr(target)


def is_imported(name: str) -> bool:
    """Module ``name`` has finished importing (it is in :data:`sys.modules` and not half way through its code)."""
    module = sys.modules.get(name)
    return module is not None and not getattr(getattr(module, "__spec__", None), "_initializing", False)


class RunAfterLoader(importlib.abc.Loader):
    """A module's own loader, then ``after()`` once the module's code has run."""

    def __init__(self, loader: Any, after: Callable[[], None]) -> None:
        self._loader = loader
        self._after = after

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return self._loader.create_module(spec)  # type: ignore[no-any-return]

    def exec_module(self, module: types.ModuleType) -> None:
        self._loader.exec_module(module)
        self._after()

    def __getattr__(self, name: str) -> Any:  # get_source, get_filename, is_package, resource readers
        return getattr(self._loader, name)


def spec_running_after(
    finder: object,
    fullname: str,
    path: Sequence[str] | None,
    target: types.ModuleType | None,
    after: Callable[[], None],
) -> importlib.machinery.ModuleSpec | None:
    """``fullname``'s spec as the finders on :data:`sys.meta_path` other than ``finder`` find it, its loader made to
    call ``after()`` once the module's code has run (a :class:`RunAfterLoader`): the ``find_spec`` of a post-import
    hook that finds nothing itself. A spec without a loader that can ``exec_module`` is returned as found."""
    for other in sys.meta_path:
        if other is finder or not hasattr(other, "find_spec"):
            continue
        spec = other.find_spec(fullname, path, target)
        if spec is not None:
            if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                spec.loader = RunAfterLoader(spec.loader, after)
            return spec
    return None


class AfterImport(importlib.abc.MetaPathFinder):
    """Runs what waits for a module right after the module is imported (a post-import hook).

    It finds nothing itself: for a watched name it asks the finders after it and wraps the loader they return.
    A target that fails is logged, never raised into the import that triggered it.
    """

    def __init__(self, watched: Mapping[str, Sequence[Target]] | None = None) -> None:
        self.pending: dict[str, list[Target]] = {name: list(targets) for name, targets in (watched or {}).items()}
        self._lock = threading.Lock()

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in self.pending:
            return None
        return spec_running_after(self, fullname, path, target, lambda: self.imported(fullname))

    def watch(self, name: str, target: Target) -> None:
        """Run ``target`` once module ``name`` has been imported: at once if it is, else right after it is.

        A target already waiting for ``name`` is not added twice.
        """
        with self._lock:
            now = is_imported(name)
            if not now:
                waiting = self.pending.setdefault(name, [])
                if target not in waiting:
                    waiting.append(target)
        if now:
            self._run(name, [target])

    def imported(self, name: str) -> None:
        """Run ``name``'s targets (once each)."""
        with self._lock:
            targets = self.pending.pop(name, [])
        self._run(name, targets)

    @staticmethod
    def _run(name: str, targets: Sequence[Target]) -> None:
        for target in targets:
            try:
                _call(target)
            except Exception:  # the import must not fail because of us; what failed is logged as an error
                what = describe(target)
                logger.exception("areal_plugins failed to register with or patch verl (%s after %s)", what, name)


def installed() -> AfterImport:
    """This process's one :class:`AfterImport`, first on :data:`sys.meta_path`, installed at the first call."""
    with _INSTALL_LOCK:
        finder = next((f for f in sys.meta_path if isinstance(f, AfterImport)), None)
        if finder is None:
            finder = AfterImport()
            sys.meta_path.insert(0, finder)
    return finder
