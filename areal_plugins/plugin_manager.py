"""The plugin manager: built-in plugins plus every installed ``areal_plugins`` entry point.

Hooks are called through :class:`Hooks` (:data:`HOOKS` for the process-wide manager), one typed method per hook,
so mypy checks each call's hook name and arguments (tox 4's pattern); like :func:`call_hook`, which calls a hook
by name, it names the plugin when one raises.
"""

from __future__ import annotations

import logging
import socket
import threading
import warnings
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any, Literal

import pluggy

from areal_plugins.builtin import BUILTIN_PLUGINS
from areal_plugins.hooks import hookspecs

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping

    from omegaconf import DictConfig

    from areal_plugins.core.trajectory import Trajectory
    from areal_plugins.hooks.contracts import RolloutManager, SampleBuffer

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
            with deprecations_logged(entry_point.name):
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
            with deprecations_logged(entry_point.name):
                plugin = entry_point.load()
                manager.register(plugin, name=entry_point.name)
        except pluggy.PluginValidationError as error:
            raise PluginError(f"plugin {entry_point.name!r} does not match the hook specs: {error}") from error
        except Exception as error:
            raise PluginError(f"plugin {entry_point.name!r} failed to load: {error!r}") from error
    check_plugins(manager)
    return manager


@contextmanager
def deprecations_logged(plugin: str) -> Iterator[None]:
    """Log, naming ``plugin``, each deprecation of ours it meets in the block: an import path that moved
    (:mod:`areal_plugins._moved`), a hook argument on its way out (``warn_on_impl_args``).

    Python's default filters hide a ``DeprecationWarning`` raised outside ``__main__``, so a run's log would not show
    that a plugin needs changing before the old path goes. Every warning is raised again afterwards, as it came, for
    the caller's own filters (a test's ``pytest.warns``, ``-W error``).
    """
    caught: list[warnings.WarningMessage] = []
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", DeprecationWarning)
            yield
    finally:
        for warning in caught:
            if issubclass(warning.category, DeprecationWarning) and "areal_" in str(warning.message):
                logger.warning("plugin %r (%s:%s): %s", plugin, warning.filename, warning.lineno, warning.message)
            warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno)


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
    configures itself and the trainer workers (``driver.hooked``), the reward workers read it from
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


#: The hooks of :mod:`~areal_plugins.hooks.hookspecs`, in their order (a unit test keeps the two the same).
HookName = Literal[
    "areal_validate_config",
    "areal_make_sample_buffer",
    "areal_make_rollout_manager",
    "areal_make_reward_fn",
    "areal_make_policy_loss",
    "areal_accept_trajectory",
    "areal_before_weight_update",
    "areal_on_weights_updated",
    "areal_after_train_step",
    "areal_on_shutdown",
]


def hook_implemented(name: HookName, manager: pluggy.PluginManager | None = None) -> bool:
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


class Hooks:
    """Every hook, one typed method each: ``areal_<phase>_<verb>`` is called as ``<phase>_<verb>`` (tox 4's facade).

    mypy checks a call's hook name and arguments, which :func:`call_hook` cannot. Each method takes the spec's
    arguments by keyword and returns what the hook returns (a ``firstresult`` hook's first answer); when an
    implementation raises, it raises :class:`PluginError` naming the plugin and the hook. What each hook means,
    returns and who calls it: :mod:`areal_plugins.hooks.hookspecs` (``docs/hooks.md``).

    Args:
        manager: the manager whose hooks to call; None: the process-wide one (:func:`get_plugin_manager`), looked up
            at each call, so a later :func:`configure_plugins` applies.
    """

    def __init__(self, manager: pluggy.PluginManager | None = None) -> None:
        self._manager = manager

    def implemented(self, name: HookName) -> bool:
        """Whether any selected plugin implements hook ``name`` (work done only for a hook can then be skipped)."""
        return hook_implemented(name, self._manager)

    # ------------------------------------------------------------ startup

    def validate_config(self, *, config: DictConfig) -> None:
        """Call ``areal_validate_config``."""
        call_hook("areal_validate_config", self._manager, config=config)

    def make_sample_buffer(self, *, config: DictConfig) -> SampleBuffer | None:
        """Call ``areal_make_sample_buffer``."""
        return call_hook("areal_make_sample_buffer", self._manager, config=config)

    def make_rollout_manager(
        self,
        *,
        config: DictConfig,
        buffer: SampleBuffer,
        submit_prompts: Callable[[int], int],
        accept_trajectory: Callable[[Trajectory], bool],
        reissue_prompts: Callable[[list[str]], None],
    ) -> RolloutManager | None:
        """Call ``areal_make_rollout_manager``."""
        return call_hook(
            "areal_make_rollout_manager",
            self._manager,
            config=config,
            buffer=buffer,
            submit_prompts=submit_prompts,
            accept_trajectory=accept_trajectory,
            reissue_prompts=reissue_prompts,
        )

    def make_reward_fn(self, *, config: Mapping[str, Any]) -> Callable[..., float] | None:
        """Call ``areal_make_reward_fn``."""
        return call_hook("areal_make_reward_fn", self._manager, config=config)

    def make_policy_loss(self) -> Callable[..., Any] | None:
        """Call ``areal_make_policy_loss`` (its deprecated ``config`` argument is passed as the None it always is)."""
        return call_hook("areal_make_policy_loss", self._manager, config=None)

    # ------------------------------------------------------------ rollout

    def accept_trajectory(self, *, trajectory: Trajectory) -> bool | None:
        """Call ``areal_accept_trajectory``."""
        return call_hook("areal_accept_trajectory", self._manager, trajectory=trajectory)

    def before_weight_update(self, *, version: int) -> None:
        """Call ``areal_before_weight_update``."""
        call_hook("areal_before_weight_update", self._manager, version=version)

    def on_weights_updated(self, *, version: int) -> None:
        """Call ``areal_on_weights_updated``."""
        call_hook("areal_on_weights_updated", self._manager, version=version)

    # ------------------------------------------------------------ training

    def after_train_step(self, *, step: int, metrics: dict[str, Any]) -> None:
        """Call ``areal_after_train_step``."""
        call_hook("areal_after_train_step", self._manager, step=step, metrics=metrics)

    # ------------------------------------------------------------ shutdown

    def on_shutdown(self, *, reason: str) -> None:
        """Call ``areal_on_shutdown``."""
        call_hook("areal_on_shutdown", self._manager, reason=reason)


#: The hooks of the process-wide plugin manager: ``HOOKS.before_weight_update(version=v)``.
HOOKS = Hooks()


def _plugin_that_raised(caller: Any, error: BaseException) -> str:
    codes = {impl.function.__code__: impl.plugin_name for impl in caller.get_hookimpls()}
    traceback = error.__traceback__
    culprit = "<unknown>"
    while traceback is not None:
        if traceback.tb_frame.f_code in codes:
            culprit = codes[traceback.tb_frame.f_code]
        traceback = traceback.tb_next
    return culprit
