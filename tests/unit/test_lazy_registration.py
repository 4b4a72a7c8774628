"""The entry point verl loads in every process registers lazily (issue 50 item 7).

Each check runs in a fresh interpreter: what ``import verl`` loads depends on what the process imported before.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

_LOADED_MODULES = """
import json, sys
import verl
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in ("verl", "ray"))))
"""

_REGISTERED = """
import json
import verl
from verl.checkpoint_engine.base import CheckpointEngineRegistry
from verl.plugin.platform import PlatformRegistry
from verl.trainer.ppo import core_algos
from verl.trainer.ppo.v1 import get_trainer_cls
from verl.workers.rollout import base
from verl.workers.rollout.replica import RolloutReplicaRegistry

print(json.dumps({
    "trainers": [get_trainer_cls(name).__name__ for name in ("areal_async", "areal_sync")],
    "losses": sorted(n for n in core_algos.POLICY_LOSS_REGISTRY if n.startswith("areal")),
    "adapters": sorted(n for (n, mode) in base._ROLLOUT_REGISTRY if n.startswith("areal")),
    "replicas": [RolloutReplicaRegistry.get(n).__name__ for n in ("areal_cpu", "areal_paced")
                 if n in RolloutReplicaRegistry._registry],
    "engine": "areal_gloo" in CheckpointEngineRegistry._registry,
    "platform": PlatformRegistry.get("cpu") is not None,
}))
"""


def _run(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    # VERL_USE_EXTERNAL_MODULES: the benchmarks name their stand-in's module there (tools/areal_bench).
    unset = ("VERL_USE_EXTERNAL_PLUGINS", "VERL_PLATFORM", "VERL_USE_EXTERNAL_MODULES")
    environment = {k: v for k, v in os.environ.items() if k not in unset}
    environment.update(env)
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=environment, timeout=240, check=True
    )


def test_import_verl_loads_no_verl_or_ray_module_beyond_verl_own_and_warns_nothing() -> None:
    without = _run(_LOADED_MODULES, VERL_USE_EXTERNAL_PLUGINS="none")
    with_us = _run(_LOADED_MODULES)
    extra = sorted(set(json.loads(with_us.stdout)) - set(json.loads(without.stdout)))
    assert extra == [], f"loading areal_plugins' entry point imported {extra}"
    assert with_us.stderr == without.stderr == "", with_us.stderr


def test_every_name_is_registered_once_verl_imports_its_registry() -> None:
    registered = json.loads(_run(_REGISTERED).stdout)
    assert registered == {
        "trainers": ["ArealAsyncTrainer", "ArealPPOTrainerSync"],
        "losses": ["areal_decoupled", "areal_decoupled_loglinear"],
        "adapters": ["areal_cpu"],  # the benchmarks' paced engine only where they register it (below)
        "replicas": ["ArealRolloutReplica"],
        "engine": True,
        "platform": True,
    }
    import areal_bench  # a bench's run: verl imports the bench's module before our plugin, in every process

    benchmark = json.loads(_run(_REGISTERED, **areal_bench.run_environment({})).stdout)
    assert benchmark["adapters"] == ["areal_cpu", "areal_paced"]
    assert benchmark["replicas"] == ["ArealRolloutReplica", "ArealRolloutReplica"]


def test_our_trainer_imported_first_is_still_registered() -> None:
    # Our module imports verl's V1 package, which finishes (and fires the registration) half way through ours.
    code = (
        "from areal_plugins.driver.async_trainer import ArealAsyncTrainer\n"
        "from verl.trainer.ppo.v1 import get_trainer_cls\n"
        "print(get_trainer_cls('areal_async') is ArealAsyncTrainer)\n"
    )
    assert _run(code).stdout.strip() == "True"


def test_a_registry_module_imported_before_the_plugin_is_served_at_once() -> None:
    code = (
        "import os\n"
        "os.environ['VERL_USE_EXTERNAL_PLUGINS'] = 'none'\n"
        "from verl.trainer.ppo import core_algos\n"
        "import areal_plugins.verl_plugin as plugin\n"
        "print('areal_decoupled' in core_algos.POLICY_LOSS_REGISTRY,"
        " 'verl.trainer.ppo.core_algos' in plugin.pending_registrations())\n"
    )
    assert _run(code).stdout.split() == ["True", "False"]


def test_a_failing_registration_is_logged_and_does_not_break_verl_import(caplog: pytest.LogCaptureFixture) -> None:
    from areal_plugins.patches._after_import import AfterImport

    finder = AfterImport({"json.tool": ("areal_plugins.no_such_module:register",)})
    finder.imported("json.tool")
    assert "areal_plugins.no_such_module:register after json.tool" in caplog.text
    assert finder.pending == {}


_CPU_PLATFORM_GLOO = """
import json, sys
import verl
from areal_plugins.patches import gloo_backend
loaded = "verl.workers.engine_workers" in sys.modules
applied = gloo_backend.is_applied()
import verl.utils.distributed as distributed
import verl.workers.engine_workers as engine_workers
name = "initialize_global_process_group_ray"
original = gloo_backend.PATCH.original("verl.utils.distributed", name)
patched = getattr(engine_workers, name)
result = {
    "loaded_by_import_verl": loaded,
    "applied": applied,
    "engine_workers_patched": patched is getattr(distributed, name) and patched is not original,
    "wraps_verl": getattr(patched, "__wrapped__", None) is original,
}
gloo_backend.revert()
result["reverted"] = getattr(engine_workers, name) is original is getattr(distributed, name)
print(json.dumps(result))
"""


def test_cpu_platform_patches_engine_workers_when_verl_imports_it_not_at_plugin_load() -> None:
    # Importing verl.workers.engine_workers at load cost every verl process on the CPU box ~2 s (issue 62, item 10).
    assert json.loads(_run(_CPU_PLATFORM_GLOO, VERL_PLATFORM="cpu").stdout) == {
        "loaded_by_import_verl": False,
        "applied": True,
        "engine_workers_patched": True,
        "wraps_verl": True,
        "reverted": True,
    }


def _on_import_patch(tmp_path, monkeypatch, tag: str):
    """A patch of ``f`` in a fresh module ``a`` and in ``b``, which imports it by name; ``b`` patched on import."""
    from areal_plugins.patches._base import AttributePatch

    from areal_plugins._compat import SUPPORTED_VERL

    a, b = f"areal_test_{tag}_a", f"areal_test_{tag}_b"
    (tmp_path / f"{a}.py").write_text("def f():\n    return 'verl'\n")
    (tmp_path / f"{b}.py").write_text(f"from {a} import f\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in (a, b):
        monkeypatch.delitem(sys.modules, name, raising=False)
    patch = AttributePatch(
        tag, ((a, "f"), (b, "f")), lambda original: lambda: "patched", SUPPORTED_VERL, on_import=frozenset({b})
    )
    return patch, a, b


def test_an_on_import_target_is_patched_when_imported_and_reverted_to_the_original(tmp_path, monkeypatch) -> None:
    import importlib

    patch, a, b = _on_import_patch(tmp_path, monkeypatch, "later")
    try:
        patch.apply()
        assert patch.is_applied() and b not in sys.modules
        module_a, module_b = importlib.import_module(a), importlib.import_module(b)
        assert module_b.f() == "patched" and module_b.f is module_a.f
        original = patch.original(b, "f")
        assert original is patch.original(a, "f") and original() == "verl"
        patch.revert()
        assert module_a.f is original and module_b.f is original
    finally:
        patch.revert()
        for name in (a, b):
            sys.modules.pop(name, None)


def test_an_on_import_target_imported_after_revert_stays_as_verl_ships_it(tmp_path, monkeypatch) -> None:
    import importlib

    patch, a, b = _on_import_patch(tmp_path, monkeypatch, "reverted")
    try:
        patch.apply()
        patch.revert()
        assert importlib.import_module(b).f() == "verl" and importlib.import_module(a).f() == "verl"
        patch.apply()  # now imported: patched at once, as any target
        assert importlib.import_module(b).f() == "patched"
    finally:
        patch.revert()
        for name in (a, b):
            sys.modules.pop(name, None)
