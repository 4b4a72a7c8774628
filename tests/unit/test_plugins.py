"""The plugin core: spec validation, error attribution, selection, docs, entry-point discovery."""

from __future__ import annotations

import importlib
import inspect
import sys
import textwrap
from pathlib import Path

import pytest

from areal_plugins.core.trajectory import Trajectory
from areal_plugins.hooks import hookspecs
from areal_plugins.hooks.hookimpl import hookimpl
from areal_plugins.plugin_manager import HookName, Hooks, PluginError, build_plugin_manager, call_hook
from areal_plugins.records.control_files import RunStoppedOnRequestError
from areal_plugins.testing import plugin_registered

DOCS = Path(__file__).resolve().parents[2] / "docs" / "hooks.md"
HOOK_NAMES = [name for name in vars(hookspecs) if name.startswith("areal_")]


def make_trajectory(reward: float) -> Trajectory:
    return Trajectory([1, 2], [3, 4, 5], [-0.1, -0.2, -0.3], [2, 2, 3], reward=reward, group_id="g")


class RejectLowReward:
    @hookimpl
    def areal_accept_trajectory(self, trajectory):
        return None if trajectory.reward >= 0.5 else False


def test_every_hook_is_documented_with_its_exact_signature():
    text = DOCS.read_text()
    for name in HOOK_NAMES:
        signature = str(inspect.signature(getattr(hookspecs, name))).replace("'", "")
        assert f"def {name}{signature}" in text, f"{name} is missing from docs/hooks.md or its signature changed"


#: The lifecycle phases, in order, and the verbs a hook name may use (areal_<phase>_<verb>...).
PHASES = ("validate", "make", "accept", "before", "on", "after")


def test_hook_names_follow_the_naming_rule_in_lifecycle_order():
    import re

    phases = []
    for name in HOOK_NAMES:
        match = re.fullmatch(r"areal_([a-z]+)(_[a-z]+)+", name)
        assert match, f"{name} is not areal_<phase>_<verb>"
        assert match.group(1) in PHASES, f"{name}: phase {match.group(1)!r} is not one of {PHASES}"
        phases.append(PHASES.index(match.group(1)))
    # Specs are declared in lifecycle order: startup (validate, make), rollout (accept), training (before,
    # on, after); shutdown (on_shutdown) is the one "on" hook after "after".
    startup_to_training = [p for name, p in zip(HOOK_NAMES, phases, strict=True) if name != "areal_on_shutdown"]
    assert startup_to_training == sorted(startup_to_training)
    assert HOOK_NAMES[-1] == "areal_on_shutdown"


def test_each_hooks_default_names_the_builtin_that_implements_it():
    from areal_plugins.builtin import BUILTIN_PLUGINS

    manager = build_plugin_manager()
    for name in HOOK_NAMES:
        doc = getattr(hookspecs, name).__doc__
        assert "Called from:" in doc and "Default:" in doc, name
        default = doc.split("Default:", 1)[1]
        implementers = {impl.plugin_name for impl in getattr(manager.hook, name).get_hookimpls()}
        builtins = sorted(implementers & {plugin for plugin, _ in BUILTIN_PLUGINS})
        if builtins:
            assert all(b.split(".")[-1] in default for b in builtins), f"{name}: Default: must name {builtins}"
        else:
            assert default.strip().startswith("none"), f"{name}: no built-in implements it; Default: says otherwise"


def test_each_hook_says_since_which_version_it_exists():
    import re

    for name in HOOK_NAMES:
        assert re.search(r"^\s*Since: \d+\.\d+\.\d+\.$", getattr(hookspecs, name).__doc__, flags=re.M), name


def deprecated_arguments(name: str) -> set[str]:
    return set(getattr(hookspecs, name).areal_plugins_spec.get("warn_on_impl_args") or {})


def test_the_facade_has_one_method_per_hook_with_the_specs_signature():
    import typing

    assert list(typing.get_args(HookName)) == HOOK_NAMES
    methods = [name for name, _ in inspect.getmembers(Hooks, inspect.isfunction) if not name.startswith("_")]
    assert sorted(methods) == sorted([name.removeprefix("areal_") for name in HOOK_NAMES] + ["implemented"])
    for name in HOOK_NAMES:
        spec = inspect.signature(getattr(hookspecs, name))
        method = inspect.signature(getattr(Hooks, name.removeprefix("areal_")))
        kept = [p for p in spec.parameters.values() if p.name not in deprecated_arguments(name)]
        expected = [(p.name, p.annotation) for p in kept]
        parameters = list(method.parameters.values())[1:]  # after self
        assert [(p.name, p.annotation) for p in parameters] == expected, name
        assert all(p.kind is p.KEYWORD_ONLY for p in parameters), f"{name}: the spec's arguments, by keyword"
        assert method.return_annotation == spec.return_annotation, name


class RecordEveryHook:
    """Implements every hook (run first) and records which was called with what."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict]] = []

    @hookimpl(tryfirst=True)
    def areal_validate_config(self, config):
        self.calls.append(("areal_validate_config", {"config": config}))

    @hookimpl(tryfirst=True)
    def areal_make_sample_buffer(self, config):
        self.calls.append(("areal_make_sample_buffer", {"config": config}))

    @hookimpl(tryfirst=True)
    def areal_make_rollout_manager(self, config, buffer, submit_prompts, accept_trajectory, reissue_prompts):
        arguments = (config, buffer, submit_prompts, accept_trajectory, reissue_prompts)
        names = ("config", "buffer", "submit_prompts", "accept_trajectory", "reissue_prompts")
        self.calls.append(("areal_make_rollout_manager", dict(zip(names, arguments, strict=True))))

    @hookimpl(tryfirst=True)
    def areal_make_reward_fn(self, config):
        self.calls.append(("areal_make_reward_fn", {"config": config}))

    @hookimpl(tryfirst=True)
    def areal_make_policy_loss(self):
        self.calls.append(("areal_make_policy_loss", {}))

    @hookimpl(tryfirst=True)
    def areal_accept_trajectory(self, trajectory):
        self.calls.append(("areal_accept_trajectory", {"trajectory": trajectory}))

    @hookimpl(tryfirst=True)
    def areal_before_weight_update(self, version):
        self.calls.append(("areal_before_weight_update", {"version": version}))

    @hookimpl(tryfirst=True)
    def areal_on_weights_updated(self, version):
        self.calls.append(("areal_on_weights_updated", {"version": version}))

    @hookimpl(tryfirst=True)
    def areal_after_train_step(self, step, metrics):
        self.calls.append(("areal_after_train_step", {"step": step, "metrics": metrics}))

    @hookimpl(tryfirst=True)
    def areal_on_shutdown(self, reason):
        self.calls.append(("areal_on_shutdown", {"reason": reason}))


def test_each_facade_method_calls_its_hook_with_its_arguments():
    import pluggy

    manager = pluggy.PluginManager(hookspecs.PROJECT_NAME)  # the specs alone: no built-in answers or checks
    manager.add_hookspecs(hookspecs)
    recorder = RecordEveryHook()
    hooks = Hooks(manager)
    trajectory = make_trajectory(1.0)
    manager_arguments = {
        "config": {"areal": {}},
        "buffer": object(),
        "submit_prompts": len,
        "accept_trajectory": bool,
        "reissue_prompts": print,
    }
    with plugin_registered(recorder, manager):
        hooks.validate_config(config={"areal": {}})
        hooks.make_sample_buffer(config={"areal": {}})
        hooks.make_rollout_manager(**manager_arguments)
        hooks.make_reward_fn(config={"areal": {"enable": True}})
        hooks.make_policy_loss()
        hooks.accept_trajectory(trajectory=trajectory)
        hooks.before_weight_update(version=3)
        hooks.on_weights_updated(version=3)
        hooks.after_train_step(step=3, metrics={})
        hooks.on_shutdown(reason="completed")
        assert hooks.implemented("areal_accept_trajectory")
    assert not hooks.implemented("areal_accept_trajectory")
    assert recorder.calls == [
        ("areal_validate_config", {"config": {"areal": {}}}),
        ("areal_make_sample_buffer", {"config": {"areal": {}}}),
        ("areal_make_rollout_manager", manager_arguments),
        ("areal_make_reward_fn", {"config": {"areal": {"enable": True}}}),
        ("areal_make_policy_loss", {}),
        ("areal_accept_trajectory", {"trajectory": trajectory}),
        ("areal_before_weight_update", {"version": 3}),
        ("areal_on_weights_updated", {"version": 3}),
        ("areal_after_train_step", {"step": 3, "metrics": {}}),
        ("areal_on_shutdown", {"reason": "completed"}),
    ]


def test_the_facade_returns_the_first_answer_and_names_a_raising_plugin():
    manager = build_plugin_manager(include=[])
    hooks = Hooks(manager)

    class Broken:
        @hookimpl
        def areal_before_weight_update(self, version):
            raise KeyError("boom")

    assert hooks.accept_trajectory(trajectory=make_trajectory(0.0)) is None
    with plugin_registered(RejectLowReward(), manager):
        assert hooks.accept_trajectory(trajectory=make_trajectory(0.0)) is False
    with plugin_registered(Broken(), manager, name="broken-observer"):
        with pytest.raises(PluginError, match=r"plugin 'broken-observer' raised in hook areal_before_weight_update"):
            hooks.before_weight_update(version=1)


def test_the_package_calls_hooks_only_through_the_facade():
    # A hook called by name escapes mypy: only the facade (plugin_manager.py) may call call_hook.
    package = Path(__file__).resolve().parents[2] / "areal_plugins"
    by_name = [
        str(path.relative_to(package))
        for path in package.rglob("*.py")
        if path.name != "plugin_manager.py" and "call_hook(" in path.read_text()
    ]
    assert by_name == [], "call hooks through plugin_manager.HOOKS / Hooks(manager)"


def test_a_policy_loss_that_still_declares_config_works_and_warns():
    from areal_plugins.core.losses import decoupled_ppo_loss

    manager = build_plugin_manager(include=[])

    def my_loss(*args, **kwargs):
        return decoupled_ppo_loss(*args, **kwargs)

    class OldStyle:
        @hookimpl
        def areal_make_policy_loss(self, config):
            assert config is None
            return my_loss

    with pytest.warns(DeprecationWarning, match=r"the config argument is deprecated.*def areal_make_policy_loss\(\)"):
        with plugin_registered(OldStyle(), manager):
            assert Hooks(manager).make_policy_loss() is my_loss


def test_accept_trajectory_firstresult_semantics():
    manager = build_plugin_manager()
    assert call_hook("areal_accept_trajectory", manager, trajectory=make_trajectory(0.0)) is None  # kept
    with plugin_registered(RejectLowReward(), manager):
        assert call_hook("areal_accept_trajectory", manager, trajectory=make_trajectory(0.0)) is False
        assert call_hook("areal_accept_trajectory", manager, trajectory=make_trajectory(1.0)) is None
    assert call_hook("areal_accept_trajectory", manager, trajectory=make_trajectory(0.0)) is None


def test_third_party_wins_over_builtin_default():
    manager = build_plugin_manager()

    class MyReward:
        @hookimpl
        def areal_make_reward_fn(self, config):
            return "mine"

    assert call_hook("areal_make_reward_fn", manager, config={}).__name__ == "compute_score"
    with plugin_registered(MyReward(), manager):
        assert call_hook("areal_make_reward_fn", manager, config={}) == "mine"


def test_a_raising_plugin_is_named_with_the_hook():
    manager = build_plugin_manager()

    class Broken:
        @hookimpl
        def areal_after_train_step(self, step, metrics):
            raise KeyError("boom")

    with plugin_registered(Broken(), manager, name="broken-metrics"):
        with pytest.raises(PluginError, match=r"plugin 'broken-metrics' raised in hook areal_after_train_step"):
            call_hook("areal_after_train_step", manager, step=1, metrics={})


def test_misspelled_hook_fails_with_the_plugin_name():
    manager = build_plugin_manager()

    class Typo:
        @hookimpl
        def areal_after_trian_step(self, step, metrics):
            return None

    with pytest.raises(PluginError, match="plugin 'typo-plugin' implements a hook"):
        with plugin_registered(Typo(), manager, name="typo-plugin"):
            pass
    assert manager.get_plugin("typo-plugin") is None  # unregistered again


def test_wrong_argument_name_fails_at_registration():
    import pluggy

    manager = build_plugin_manager()

    class WrongArgs:
        @hookimpl
        def areal_on_weights_updated(self, new_version):
            return None

    with pytest.raises(pluggy.PluginValidationError, match="new_version"):
        with plugin_registered(WrongArgs(), manager):
            pass


def test_after_train_step_plugins_may_add_metrics():
    manager = build_plugin_manager()

    class AddMetric:
        @hookimpl
        def areal_after_train_step(self, step, metrics):
            metrics["myplugin/step_squared"] = step * step

    metrics: dict = {}
    with plugin_registered(AddMetric(), manager):
        call_hook("areal_after_train_step", manager, step=3, metrics=metrics)
    assert metrics == {"myplugin/step_squared": 9}


@pytest.fixture
def installed_example_plugin(tmp_path, monkeypatch):
    """A plugin distributed only through the entry-point group: a real .dist-info on sys.path."""
    (tmp_path / "areal_example_filter.py").write_text(
        textwrap.dedent(
            """
            from areal_plugins import hookimpl

            @hookimpl
            def areal_accept_trajectory(trajectory):
                return False if trajectory.reward == 0 else None
            """
        )
    )
    dist = tmp_path / "areal_example_filter-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: areal-example-filter\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[areal_plugins]\nexample_filter = areal_example_filter\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "example_filter"
    sys.modules.pop("areal_example_filter", None)


def test_entry_point_plugin_is_discovered_and_selectable(installed_example_plugin):
    manager = build_plugin_manager()
    assert manager.get_plugin(installed_example_plugin) is not None
    assert call_hook("areal_accept_trajectory", manager, trajectory=make_trajectory(0.0)) is False
    excluded = build_plugin_manager(exclude=[installed_example_plugin])
    assert excluded.get_plugin(installed_example_plugin) is None
    with pytest.raises(
        PluginError, match=r"not installed on \S+; installed plugins: \[.*'example_filter'.*\]\. On a cluster"
    ):
        build_plugin_manager(include=["exmaple_filter"])


def test_an_opt_in_plugin_loads_only_when_named(installed_example_plugin, tmp_path):
    module = tmp_path / "areal_example_filter.py"
    module.write_text("AREAL_PLUGIN_OPT_IN = True\n" + module.read_text())
    assert build_plugin_manager().get_plugin(installed_example_plugin) is None  # installed, not asked for
    assert build_plugin_manager(include=[installed_example_plugin]).get_plugin(installed_example_plugin) is not None


@pytest.fixture
def installed_broken_plugin(tmp_path):
    """A plugin whose module raises on import (and counts its imports), installed through the entry-point group;
    taken off ``sys.path`` again after the test."""
    imports = tmp_path / "imports.log"
    (tmp_path / "areal_broken_plugin.py").write_text(
        f"with open({str(imports)!r}, 'a') as log:\n"
        "    log.write('imported\\n')\n"
        "raise ImportError('areal_broken_plugin needs a package that is not installed')\n"
    )
    dist = tmp_path / "areal_broken_plugin-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: areal-broken-plugin\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[areal_plugins]\nbroken = areal_broken_plugin\n")
    sys.path.insert(0, str(tmp_path))
    importlib.invalidate_caches()
    try:
        yield "broken", imports
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("areal_broken_plugin", None)
        importlib.invalidate_caches()


def test_an_excluded_plugin_is_never_imported(installed_broken_plugin):
    from areal_plugins.plugin_manager import selected_plugin_names

    name, imports = installed_broken_plugin
    with pytest.raises(PluginError, match=r"plugin 'broken' failed to load: ImportError"):
        build_plugin_manager()  # selected by default: it is imported, and its failure is named
    assert imports.read_text().count("imported") == 1
    imports.unlink()
    assert build_plugin_manager(exclude=[name]).get_plugin(name) is None  # areal.plugins.exclude: [broken]
    assert selected_plugin_names(None, [name]) == []  # the driver's selection for every worker
    assert build_plugin_manager(include=["m2po"], exclude=[name]).get_plugin("m2po") is not None
    assert not imports.exists(), "an excluded plugin was imported"


def test_m2po_is_shipped_opt_in_and_replaces_the_loss_when_included():
    from areal_plugins.objectives.m2po import m2po_loss
    from areal_plugins.plugin_manager import installed_plugin_names

    assert "m2po" in installed_plugin_names()  # our own entry point (pyproject.toml)
    assert call_hook("areal_make_policy_loss", build_plugin_manager(), config=None) is not m2po_loss
    assert call_hook("areal_make_policy_loss", build_plugin_manager(include=["m2po"]), config=None) is m2po_loss


def test_trajectory_versions_and_staleness():
    trajectory = make_trajectory(1.0)
    assert trajectory.head_version == 2
    assert trajectory.token_versions == [-1, -1, 2, 2, 3]
    assert trajectory.staleness(5) == 3
    with pytest.raises(ValueError, match="one entry per response token"):
        Trajectory([1], [2, 3], [-0.1], [0, 0])


def test_docs_are_regenerated_from_the_specs():
    from tests.unit.tool_scripts import load_tool

    assert DOCS.read_text() == load_tool("gen_hook_docs").render(), "run: python tools/gen_hook_docs.py"


def test_policy_loss_hook_chooses_the_workers_loss():
    from areal_plugins.core.losses import decoupled_ppo_loss
    from areal_plugins.hooks.hookimpl import hookimpl
    from areal_plugins.testing import plugin_registered
    from areal_plugins.trainer_workers import policy_loss as verl_loss

    def my_loss(*args, **kwargs):
        return decoupled_ppo_loss(*args, **kwargs)

    class MyLoss:
        @staticmethod
        @hookimpl
        def areal_make_policy_loss():
            return my_loss

    verl_loss._pure_loss = None
    try:
        with plugin_registered(MyLoss()):
            assert verl_loss.pure_loss() is my_loss
        verl_loss._pure_loss = None
        assert verl_loss.pure_loss() is decoupled_ppo_loss  # the built-in default
    finally:
        verl_loss._pure_loss = None


def test_all_installed_means_the_drivers_plugins_for_every_worker(installed_example_plugin):
    from omegaconf import OmegaConf

    from areal_plugins.driver.hooked import pin_plugin_selection
    from areal_plugins.plugin_manager import selected_plugin_names

    assert selected_plugin_names(None, []) == [installed_example_plugin]
    assert selected_plugin_names(None, [installed_example_plugin]) == []
    for resolved in (False, True):  # verl may resolve the recipe's interpolation before our trainer runs
        config = OmegaConf.create(
            {
                "areal": {"plugins": {"include": None, "exclude": ["other"]}},
                "reward": {"custom_reward_function": {"reward_kwargs": {"areal_plugins": "${areal.plugins}"}}},
            }
        )
        if resolved:
            OmegaConf.resolve(config)
        OmegaConf.set_struct(config, True)
        pin_plugin_selection(config, [installed_example_plugin])
        for node in (config.areal.plugins, config.reward.custom_reward_function.reward_kwargs.areal_plugins):
            assert OmegaConf.to_container(node) == {"include": [installed_example_plugin], "exclude": []}


class _VerlFit:
    """Stands in for verl's ``fit``: returns, or raises like a failed step."""

    def __init__(self, error: BaseException | None = None) -> None:
        self.error = error

    def fit(self, agent_loop_manager):
        if self.error is not None:
            raise self.error


@pytest.mark.parametrize(
    "error, reason",
    [
        (None, "completed"),
        (RuntimeError("step failed"), "error"),
        (RunStoppedOnRequestError("step failed: stopped on request"), "interrupted"),  # Ctrl-C between two steps
    ],
)
def test_shutdown_is_the_last_hook_after_the_rollout_stopped(error, reason):
    # The async trainer admits trajectories from a thread: areal_on_shutdown must come after it stopped,
    # or a plugin sees areal_accept_trajectory after being told the run ended.
    from areal_plugins.driver.hooked import HookedTrainerMixin

    calls: list[str] = []

    class Trainer(HookedTrainerMixin, _VerlFit):
        def stop_rollout(self) -> None:
            calls.append("stop_rollout")

    class Observer:
        @hookimpl
        def areal_on_shutdown(self, reason):
            calls.append(f"shutdown:{reason}")

    with plugin_registered(Observer()):
        if error is None:
            Trainer().fit(None)
        else:
            with pytest.raises(RuntimeError, match="step failed"):
                Trainer(error).fit(None)
    assert calls == ["stop_rollout", f"shutdown:{reason}"]
