"""What the CLI adds to verl's command line so that a run joins a cluster and its workers see the run."""

from __future__ import annotations

import pytest

from areal_plugins import cli
from areal_plugins.cli import cluster_env


def test_the_run_settings_travel_in_the_jobs_runtime_env():
    env = {"AREAL_RUN_DIR": "/runs/a", "VERL_PLATFORM": "cpu", "HOME": "/root", "AREAL_TINY_DIR": ""}
    assert cluster_env.job_env_overrides(env) == [
        "++ray_kwargs.ray_init.runtime_env.env_vars.AREAL_RUN_DIR='/runs/a'",
        "++ray_kwargs.ray_init.runtime_env.env_vars.VERL_PLATFORM='cpu'",
    ]


def test_a_path_that_cannot_be_quoted_is_refused():
    with pytest.raises(SystemExit, match="rename it"):
        cluster_env.job_env_overrides({"AREAL_RUN_DIR": "/runs/it's"})


@pytest.mark.parametrize(
    ("env", "overrides", "expected"),
    [
        ({"RAY_ADDRESS": "10.0.0.1:6379"}, [], "10.0.0.1:6379"),
        ({"RAY_ADDRESS": "local"}, [], None),
        ({}, ["+ray_kwargs.ray_init.address=10.0.0.2:6379"], "10.0.0.2:6379"),
        ({"RAY_ADDRESS": "10.0.0.1:6379"}, ["ray_kwargs.ray_init.address=null"], "10.0.0.1:6379"),
        ({}, [], None),
    ],
)
def test_the_cluster_a_run_joins(env, overrides, expected, monkeypatch):
    monkeypatch.setattr(cluster_env, "running_local_cluster", lambda: None)
    assert cluster_env.cluster_address(env, overrides) == expected


def test_joining_a_cluster_drops_the_sizes_of_a_cluster_ray_would_start():
    assert cluster_env.join_cluster_overrides(None) == []
    assert cluster_env.join_cluster_overrides("10.0.0.1:6379") == [
        "ray_kwargs.ray_init.num_cpus=null",
        "ray_kwargs.ray_init.num_gpus=null",
        "ray_kwargs.ray_init.object_store_memory=null",
    ]


def test_every_environment_variable_a_worker_reads_travels_with_the_job():
    """A worker on another node sees the job's runtime_env, never the CLI's shell: the package reads only
    variables the CLI sends with the job (the CLI itself excepted)."""
    import re
    from pathlib import Path

    import areal_plugins

    package = Path(areal_plugins.__file__).parent
    constants = {
        "RUN_DIR_ENV": "AREAL_RUN_DIR",
        "CORRUPT_VARIABLE": "AREAL_CORRUPT_RECEIVED_WEIGHT",
        "CORRUPT_LOADED_VARIABLE": "AREAL_CORRUPT_LOADED_WEIGHT",
        "STEP_DELAY_ENV": "AREAL_TEST_ENGINE_STEP_DELAY_S",
        "MICRO_BATCH_DELAY_ENV": "AREAL_TEST_TRAINER_MICROBATCH_DELAY_S",
        "BENCH_ENV": "AREAL_BENCH_BACKENDS",
    }
    read = re.compile(r"os\.environ(?:\.get\(|\[)\s*([A-Z_]+|\"[A-Z_]+\")")
    names = set()
    for path in package.rglob("*.py"):
        if path.relative_to(package).as_posix() in ("cli/__init__.py", "cli/launch.py", "cli/cluster_env.py"):
            continue  # the CLI's own process
        for token in read.findall(path.read_text()):
            names.add(constants.get(token, token.strip('"')))
    # RANK: verl's worker sets it in every worker process itself (our rollout adapter reads it, as verl's does).
    set_by_verl = {"RANK"}
    # Fault injection: a test sets it in the job's runtime_env itself (++ray_kwargs.ray_init.runtime_env...).
    # The speed knobs of a test run (CONTRIBUTING.md): a local run's workers inherit them from the test's environment.
    set_by_tests = {
        "AREAL_CORRUPT_RECEIVED_WEIGHT",
        "AREAL_CORRUPT_LOADED_WEIGHT",
        "AREAL_TEST_ENGINE_STEP_DELAY_S",
        "AREAL_TEST_TRAINER_MICROBATCH_DELAY_S",
        # The benchmarks' opt-in to their engine stand-in: tools/ set it before the run's local Ray starts.
        "AREAL_BENCH_BACKENDS",
    }
    expected = {
        "AREAL_RUN_DIR",
        "VERL_PLATFORM",
        "RANK",
        "AREAL_CORRUPT_RECEIVED_WEIGHT",
        "AREAL_CORRUPT_LOADED_WEIGHT",
        "AREAL_TEST_ENGINE_STEP_DELAY_S",
        "AREAL_TEST_TRAINER_MICROBATCH_DELAY_S",
        "AREAL_BENCH_BACKENDS",
    }
    assert names == expected  # found by grep, listed by hand
    assert names - set_by_verl - set_by_tests <= set(cluster_env.JOB_ENV_VARS)


def test_joining_nulls_only_the_sizes_the_recipe_has():
    """verl's own ray_init node has no num_gpus or object_store_memory: nulling them would be an unknown key."""
    assert cluster_env.join_cluster_overrides("10.0.0.1:6379", ["num_cpus", "runtime_env"]) == [
        "ray_kwargs.ray_init.num_cpus=null"
    ]
    assert cluster_env.join_cluster_overrides("10.0.0.1:6379", ["runtime_env"]) == []


def test_the_gpu_recipes_join_a_cluster_with_overrides_hydra_accepts(monkeypatch, tmp_path):
    """The overrides train passes to main_ppo when joining a cluster compose with a GPU recipe."""
    from pathlib import Path

    from areal_plugins.cli.preflight import check_recipe

    monkeypatch.setenv("AREAL_DATA_DIR", str(tmp_path))
    recipe = Path(__file__).resolve().parents[2] / "recipes" / "gpu" / "grpo_1.5b_two_nodes.yaml"
    config = check_recipe(recipe, [])
    check_recipe(recipe, cluster_env.join_cluster_overrides("head:6379", config.ray_kwargs.ray_init.keys()))


def test_overrides_after_the_options_are_overrides(caplog, monkeypatch, tmp_path):
    """``check RECIPE --nodes 1 --gpus-per-node 8 KEY=VALUE``: the late override is applied (here: refused)."""
    import logging
    from pathlib import Path

    monkeypatch.setenv("AREAL_DATA_DIR", str(tmp_path))
    recipe = Path(__file__).resolve().parents[2] / "recipes" / "gpu" / "grpo_1.5b_separate.yaml"
    argv = [
        "check",
        str(recipe),
        "--nodes",
        "1",
        "--gpus-per-node",
        "8",
        "actor_rollout_ref.actor.ppo_mini_batch_size=48",
    ]
    with caplog.at_level(logging.INFO):
        assert cli.main(argv) == 2
    assert any("ppo_mini_batch_size=48 must divide data.train_batch_size=128" in r.getMessage() for r in caplog.records)
