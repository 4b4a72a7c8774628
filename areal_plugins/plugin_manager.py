"""The plugin manager: built-in plugins plus every installed ``areal_plugins`` entry point.

Hooks are called through :func:`call_hook`, which names the plugin when one raises.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Iterable
from importlib.metadata import entry_points
from typing import Any

import pluggy

from areal_plugins.builtin import BUILTIN_PLUGINS
from areal_plugins.hooks import hookspecs

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "areal_plugins"

_lock = threading.Lock()
_manager: pluggy.PluginManager | None = None


class PluginError(RuntimeError):
    """A plugin failed: it raised inside a hook, or it does not match the hook specs.

    ``plugin`` names the plugin that raised inside a hook (None when no single plugin is to blame).
    """

    def __init__(self, message: str, plugin: str | None = None) -> None:
        super().__init__(message)
        self.plugin = plugin


#: A plugin module that sets this attribute true is loaded only when ``areal.plugins.include`` names it
#: (an objective that replaces the default loss must be asked for, not switched on by installing it).
OPT_IN_ATTRIBUTE = "AREAL_PLUGIN_OPT_IN"


def selected_plugin_names(include: Iterable[str] | None = None, exclude: Iterable[str] = ()) -> list[str]:
    """The third-party plugins ``include``/``exclude`` select here (None: every installed one not opt-in)."""
    excluded = set(exclude)
    chosen = default_plugin_names(excluded) if include is None else list(include)
    return sorted(set(chosen) - excluded)


def installed_plugin_names() -> list[str]:
    """Names of the plugins installed through the ``areal_plugins`` entry-point group."""
    return sorted(ep.name for ep in entry_points(group=ENTRY_POINT_GROUP))


def default_plugin_names(exclude: Iterable[str] = ()) -> list[str]:
    """The installed plugins loaded when ``areal.plugins.include`` is null: all but the opt-in ones and ``exclude``.

    Reading a plugin's opt-in flag imports it, so the excluded ones are skipped first: never imported, a plugin
    that fails to import can be excluded (``areal.plugins.exclude``).
    """
    excluded = set(exclude)
    names = []
    for entry_point in entry_points(group=ENTRY_POINT_GROUP):
        if entry_point.name in excluded:
            continue
        try:
            opt_in = bool(getattr(entry_point.load(), OPT_IN_ATTRIBUTE, False))
        except Exception as error:
            raise PluginError(f"plugin {entry_point.name!r} failed to load: {error!r}") from error
        if not opt_in:
            names.append(entry_point.name)
    return sorted(names)


def build_plugin_manager(include: Iterable[str] | None = None, exclude: Iterable[str] = ()) -> pluggy.PluginManager:
    """Return a new manager with the built-ins and the selected third-party plugins, validated.

    Args:
        include: entry-point names to load (None: all installed but the opt-in ones).
        exclude: entry-point names to skip.

    Raises:
        PluginError: an unknown plugin name, a plugin that fails to import, or a hook implementation
            that is misspelled or takes arguments the spec does not offer.
    """
    available = installed_plugin_names()
    exclude_set = set(exclude)
    include_set = set(default_plugin_names(exclude_set) if include is None else include)
    unknown = sorted((include_set | exclude_set) - set(available))
    if unknown:
        raise PluginError(
            f"areal.plugins names {unknown}, which are not installed on {socket.gethostname()}; installed plugins: "
            f"{available or 'none'}. On a cluster every node needs the plugins the driver's machine loads"
        )
    manager = pluggy.PluginManager(hookspecs.PROJECT_NAME)
    manager.add_hookspecs(hookspecs)
    for name, plugin in BUILTIN_PLUGINS:
        manager.register(plugin, name=name)
    for entry_point in entry_points(group=ENTRY_POINT_GROUP):
        if entry_point.name not in include_set or entry_point.name in exclude_set:
            continue
        try:
            plugin = entry_point.load()
            manager.register(plugin, name=entry_point.name)
        except pluggy.PluginValidationError as error:
            raise PluginError(f"plugin {entry_point.name!r} does not match the hook specs: {error}") from error
        except Exception as error:
            raise PluginError(f"plugin {entry_point.name!r} failed to load: {error!r}") from error
    check_plugins(manager)
    return manager


def check_plugins(manager: pluggy.PluginManager) -> None:
    """Fail when a registered plugin implements a hook that has no spec (a misspelling)."""
    try:
        manager.check_pending()
    except pluggy.PluginValidationError as error:
        raise PluginError(
            f"plugin {manager.get_name(error.plugin)!r} implements a hook areal_plugins does not define: {error}. "
            f"Hooks: {', '.join(sorted(n for n in dir(hookspecs) if n.startswith('areal_')))}"
        ) from error


def get_plugin_manager() -> pluggy.PluginManager:
    """The process-wide manager: every installed plugin until :func:`configure_plugins` selects some.

    The run's selection (``areal.plugins``) reaches each process from the composed config: the driver
    configures itself and the trainer workers (``trainers.hooked``), the reward workers read it from
    their ``reward_kwargs`` (``rewards.hooked``).
    """
    global _manager
    with _lock:
        if _manager is None:
            _manager = build_plugin_manager()
        return _manager


def configure_plugins(include: Iterable[str] | None = None, exclude: Iterable[str] = ()) -> pluggy.PluginManager:
    """Rebuild the process-wide manager with the plugin selection of ``areal.plugins``."""
    global _manager
    manager = build_plugin_manager(include, exclude)
    with _lock:
        _manager = manager
    return manager


def hook_implemented(name: str, manager: pluggy.PluginManager | None = None) -> bool:
    """Whether any selected plugin implements hook ``name`` (work done only for a hook can then be skipped)."""
    return bool(getattr((manager or get_plugin_manager()).hook, name).get_hookimpls())


def call_hook(name: str, manager: pluggy.PluginManager | None = None, **kwargs: Any) -> Any:
    """Call hook ``name``; if an implementation raises, raise :class:`PluginError` naming it."""
    manager = manager or get_plugin_manager()
    caller = getattr(manager.hook, name)
    try:
        return caller(**kwargs)
    except Exception as error:
        culprit = _plugin_that_raised(caller, error)
        raise PluginError(f"plugin {culprit!r} raised in hook {name}: {error!r}", plugin=culprit) from error


def _plugin_that_raised(caller: Any, error: BaseException) -> str:
    codes = {impl.function.__code__: impl.plugin_name for impl in caller.get_hookimpls()}
    traceback = error.__traceback__
    culprit = "<unknown>"
    while traceback is not None:
        if traceback.tb_frame.f_code in codes:
            culprit = codes[traceback.tb_frame.f_code]
        traceback = traceback.tb_next
    return culprit
