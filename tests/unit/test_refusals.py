"""Every kind of bad input to ``areal-plugins train`` is refused before anything starts, in one line that names
the key and what to set, with exit code 2 and no traceback."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from areal_plugins import cli
from areal_plugins.cli import launch, progress
from areal_plugins.cli.preflight import RecipeRefusedError, check_recipe

REPO = Path(__file__).resolve().parents[2]
ASYNC = REPO / "recipes" / "grpo_cpu_async.yaml"


@pytest.fixture(autouse=True)
def tiny_dirs(monkeypatch, tmp_path):
    """Recipes read their model and data paths from these; nothing is built for a refusal."""
    monkeypatch.setenv("AREAL_TINY_DIR", str(tmp_path))
    monkeypatch.setenv("AREAL_TINY_CALCULATOR_DIR", str(tmp_path))
    monkeypatch.setenv("AREAL_TINY_VISION_DIR", str(tmp_path))
    monkeypatch.delenv("VERL_PLATFORM", raising=False)  # as on a user's machine: the recipe decides
    monkeypatch.setattr(launch, "cluster_address", lambda env, overrides: None)  # whatever Ray runs on this box


def refusal_of(caplog, recipe: Path, *overrides: str) -> str:
    """Run the CLI's train on a bad recipe; return its one error line (asserting it was refused in one line)."""

    def nothing_may_start(*args, **kwargs):
        raise AssertionError("a refused recipe must not build assets or start verl")

    with pytest.MonkeyPatch.context() as patch, caplog.at_level(logging.INFO):
        patch.setattr(launch, "ensure_tiny_assets", nothing_may_start)
        patch.setattr(launch, "BoundedLog", nothing_may_start)  # the run log, opened just before verl starts
        code = cli.main(["train", str(recipe), *overrides, "--tiny-dir", os.environ["AREAL_TINY_DIR"]])
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert code == 2
    assert len(errors) == 1, errors
    assert "\n" not in errors[0] and "Traceback" not in errors[0]
    assert errors[0].startswith("refused: ")
    return errors[0]


def test_a_misspelled_areal_key_names_the_closest_valid_one(caplog):
    line = refusal_of(caplog, ASYNC, "areal.max_stalenes=2")
    assert line == "refused: unknown setting areal.max_stalenes; did you mean areal.max_staleness?"


def test_a_misspelled_verl_key_names_the_closest_valid_one(caplog):
    line = refusal_of(caplog, ASYNC, "trainer.total_training_step=3")
    assert line == "refused: unknown setting trainer.total_training_step; did you mean trainer.total_training_steps?"


def test_an_unknown_key_with_nothing_close_says_how_to_add_one(caplog):
    line = refusal_of(caplog, ASYNC, "trainer.zzzzqqq=1")
    assert "unknown setting trainer.zzzzqqq; a new key needs a leading + (+trainer.zzzzqqq=...)" in line


def test_a_bad_value_names_the_key_and_the_allowed_values(caplog):
    line = refusal_of(caplog, ASYNC, "areal.max_staleness=-1")
    assert "areal.max_staleness must be an integer >= 0" in line and "-1" in line


def test_a_bad_choice_lists_the_choices(caplog):
    line = refusal_of(caplog, ASYNC, "areal.placement=disaggregated")
    assert "areal.placement must be one of ('colocated', 'separate'), got 'disaggregated'" in line


def test_an_unsupported_backend_names_what_it_lacks_and_what_to_set(caplog):
    line = refusal_of(caplog, ASYNC, "actor_rollout_ref.rollout.name=sglang")
    assert "actor_rollout_ref.rollout.name=sglang lacks" in line and "areal.waive_capabilities=" in line


def test_an_unsupported_combination_names_the_key_to_change(caplog):
    line = refusal_of(caplog, ASYNC, "areal.placement=separate")
    assert "actor_rollout_ref.rollout.checkpoint_engine.backend=nccl" in line


def test_a_missing_recipe(caplog):
    line = refusal_of(caplog, REPO / "recipes" / "no_such_recipe.yaml")
    assert "no_such_recipe.yaml does not exist" in line


def test_an_unreadable_override(caplog):
    line = refusal_of(caplog, ASYNC, "trainer.total_training_steps")
    assert "cannot read the override 'trainer.total_training_steps': write KEY=VALUE" in line


def test_a_missing_config_group_option_lists_the_available_ones(caplog):
    line = refusal_of(caplog, ASYNC, "areal=nope")
    assert "Could not find 'areal/nope'; available: default" in line


def test_an_unsupported_verl_version(caplog, monkeypatch):
    import areal_plugins._compat as compat

    monkeypatch.setattr(compat, "installed_verl_version", lambda: "0.8.0")
    line = refusal_of(caplog, ASYNC)
    assert "verl 0.8.0 is installed" in line and "pip install" in line


def test_a_recipe_that_overrides_a_routed_key(caplog):
    line = refusal_of(caplog, ASYNC, "actor_rollout_ref.actor.policy_loss.loss_mode=gspo")
    assert "remove actor_rollout_ref.actor.policy_loss.loss_mode from the recipe" in line


def test_the_check_refuses_a_shipped_recipe_made_invalid():
    """The guard of test_check.py's every-recipe test: the same checks refuse a recipe made invalid (here: a
    separate pool with no weight transport), as they refused the shipped vLLM recipe before it got one."""
    separate = REPO / "recipes" / "grpo_cpu_async_separate.yaml"
    with pytest.raises(RecipeRefusedError, match=r"checkpoint_engine\.backend"):
        check_recipe(separate, ["actor_rollout_ref.rollout.checkpoint_engine.backend=naive"])


def test_the_terminal_shows_one_line_for_a_misspelled_key(tmp_path):
    """Through the installed command, as a user runs it: stderr is one line, stdout empty, exit code 2."""
    command = [str(Path(sys.executable).with_name("areal-plugins")), "train", str(ASYNC), "areal.max_stalenes=2"]
    result = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path, env={**os.environ})
    assert result.returncode == 2
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].endswith("refused: unknown setting areal.max_stalenes; did you mean areal.max_staleness?")
    assert not list(tmp_path.iterdir()), "a refused run writes nothing"


@pytest.mark.parametrize(
    ("line", "cause"),
    [
        ("ValueError: bad batch", "ValueError: bad batch"),
        (
            "(TaskRunner pid=123) omegaconf.errors.ConfigKeyError: Key 'x' missing",
            "omegaconf.errors.ConfigKeyError: Key 'x' missing",
        ),
        (
            "ray.exceptions.RayTaskError(ArealConfigError): ray::TaskRunner.run()",
            "ray.exceptions.RayTaskError(ArealConfigError): ray::TaskRunner.run()",
        ),
        ("Error executing job with overrides: []", None),
        ("INFO: no ValueError here", None),
        ("Traceback (most recent call last):", None),
    ],
)
def test_the_cause_of_a_failed_run_is_read_from_the_traceback_tail(line, cause):
    match = progress.ERROR_LINE.match(line)
    assert (match.group(1) if match else None) == cause


def install_plugin(folder: Path, monkeypatch, entry: str, module: str, hook_body: str) -> None:
    """An installed third-party plugin: a module and a dist-info with an ``areal_plugins`` entry point."""
    (folder / f"{module}.py").write_text(
        f"from areal_plugins import hookimpl\n\n\n@hookimpl\ndef areal_validate_config(config):\n    {hook_body}\n"
    )
    dist = folder / f"{module}-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {module.replace('_', '-')}\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(f"[areal_plugins]\n{entry} = {module}\n")
    monkeypatch.syspath_prepend(str(folder))


def test_a_plugin_that_refuses_is_named(caplog, tmp_path, monkeypatch):
    """A ValueError is how a plugin refuses settings: its message, and the plugin's name."""
    install_plugin(
        tmp_path,
        monkeypatch,
        "refuser",
        "refusing_plugin",
        "raise ValueError('set areal.max_staleness <= 1 for this plugin')",
    )
    line = refusal_of(caplog, ASYNC)
    assert line == "refused: plugin 'refuser' refuses the recipe: set areal.max_staleness <= 1 for this plugin"


def test_a_plugin_that_crashes_is_named(caplog, tmp_path, monkeypatch):
    install_plugin(tmp_path, monkeypatch, "crasher", "crashing_plugin", "return 1 / 0")
    line = refusal_of(caplog, ASYNC)
    assert "plugin 'crasher' raised in hook areal_validate_config: ZeroDivisionError" in line


def test_the_recipe_decides_the_platform_not_the_head_nodes_hardware():
    from areal_plugins.cli.preflight import run_platform

    # A CPU-only head node joining a GPU cluster: verl's own detection runs in each (GPU) worker.
    assert run_platform("cuda", local_accelerator=False, cluster="10.0.0.1:6379", preset=None) is None
    assert run_platform("cuda", local_accelerator=True, cluster=None, preset=None) is None
    # A CPU recipe runs on the CPU platform everywhere, even on a machine with a GPU.
    assert run_platform("cpu", local_accelerator=True, cluster=None, preset=None) == "cpu"
    # The user's own VERL_PLATFORM wins.
    assert run_platform("cuda", local_accelerator=False, cluster="head:6379", preset="npu") == "npu"


def test_a_gpu_recipe_with_nowhere_to_run_is_refused(caplog):
    line = refusal_of(caplog, ASYNC, "trainer.device=cuda")
    assert "trainer.device=cuda, but this machine has no GPU and joins no Ray cluster" in line
