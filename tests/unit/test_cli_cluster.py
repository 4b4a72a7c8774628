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
        # The tests' fault and speed plan (testing/faults.py) reads each of its variables by its constant.
        "CORRUPT_RECEIVED_ENV": "AREAL_CORRUPT_RECEIVED_WEIGHT",
        "CORRUPT_LOADED_ENV": "AREAL_CORRUPT_LOADED_WEIGHT",
        "DROP_RECEIVED_ENV": "AREAL_DROP_RECEIVED_WEIGHT",
        "RENAME_RECEIVED_ENV": "AREAL_RENAME_RECEIVED_WEIGHT",
        "ENGINE_STEP_DELAY_ENV": "AREAL_TEST_ENGINE_STEP_DELAY_S",
        "TRAINER_MICROBATCH_DELAY_ENV": "AREAL_TEST_TRAINER_MICROBATCH_DELAY_S",
        "API_SERVER_VARIABLE": "RAY_API_SERVER_ADDRESS",
    }
    # A read names its variable at the call: os.environ's.
    read = re.compile(r"os\.environ(?:\.get\(|\[)\s*([A-Z_]+|\"[A-Z_]+\")")
    # A read through a parameter is a helper's: the scan finds its variables only at its callers, so each helper
    # is listed here with the call the scan reads (above); a new one fails below until it is.
    through_a_parameter = re.compile(r"os\.environ(?:\.get\(|\[)\s*[a-z_]")
    helpers: set[str] = set()
    names, readers = set(), set()
    for path in package.rglob("*.py"):
        relative = path.relative_to(package).as_posix()
        if relative in ("cli/__init__.py", "cli/launch.py", "cli/cluster_env.py"):
            continue  # the CLI's own process
        for token in read.findall(path.read_text()):
            names.add(constants.get(token, token.strip('"')))
        if through_a_parameter.search(path.read_text()):
            readers.add(relative)
    assert readers == helpers, f"environment read through a parameter in {sorted(readers - helpers)}: scan its calls"
    # RANK: verl's worker sets it in every worker process itself (our rollout adapter reads it, as verl's does).
    # VERL_REPLICA_RANK: verl's vLLM server sets it in its own process (vllm_async_server.py) before the workers start.
    set_by_verl = {"RANK", "VERL_REPLICA_RANK"}
    # RAY_API_SERVER_ADDRESS: set by the process itself from its own cluster's GCS address (driver/actor_liveness.py),
    # a user's own setting kept; it must not travel (another node's process pins its own).
    set_in_the_process = {"RAY_API_SERVER_ADDRESS"}
    # Fault injection: a test sets it in the job's runtime_env itself (++ray_kwargs.ray_init.runtime_env...).
    # The speed knobs of a test run (CONTRIBUTING.md): a local run's workers inherit them from the test's environment.
    set_by_tests = {
        "AREAL_CORRUPT_RECEIVED_WEIGHT",
        "AREAL_CORRUPT_LOADED_WEIGHT",
        "AREAL_DROP_RECEIVED_WEIGHT",
        "AREAL_RENAME_RECEIVED_WEIGHT",
        "AREAL_TEST_ENGINE_STEP_DELAY_S",
        "AREAL_TEST_TRAINER_MICROBATCH_DELAY_S",
    }
    expected = {
        "AREAL_RUN_DIR",
        "VERL_PLATFORM",
        "RANK",
        "VERL_REPLICA_RANK",
        "AREAL_CORRUPT_RECEIVED_WEIGHT",
        "AREAL_CORRUPT_LOADED_WEIGHT",
        "AREAL_DROP_RECEIVED_WEIGHT",
        "AREAL_RENAME_RECEIVED_WEIGHT",
        "AREAL_TEST_ENGINE_STEP_DELAY_S",
        "AREAL_TEST_TRAINER_MICROBATCH_DELAY_S",
        "RAY_API_SERVER_ADDRESS",
    }
    assert names == expected  # found by grep, listed by hand
    assert names - set_by_verl - set_by_tests - set_in_the_process <= set(cluster_env.JOB_ENV_VARS)
    assert not set_in_the_process & set(cluster_env.JOB_ENV_VARS)


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


@pytest.mark.parametrize(
    ("open_to_anyone", "shell_mode", "expected"),
    [
        (True, None, "accepts a client that sends no token: anyone who can reach its GCS port can run code"),
        (True, "token", "accepts a client that sends no token"),  # the shell's token does not close the cluster
        (False, None, "asks for a token, and this shell does not set RAY_AUTH_MODE=token"),
        (False, "token", None),
        (None, None, None),  # not reached (or a ray:// address): nothing to say
    ],
)
def test_what_check_says_about_who_can_reach_the_cluster(open_to_anyone, shell_mode, expected):
    env = {} if shell_mode is None else {"RAY_AUTH_MODE": shell_mode}
    warning = cluster_env.auth_warning("10.0.0.2:6379", open_to_anyone, env)
    if expected is None:
        assert warning is None
    else:
        assert expected in warning and "10.0.0.2:6379" in warning
        assert ("RAY_AUTH_MODE=token ray start" in warning) == bool(open_to_anyone)  # how to close it


def check_cpu_recipe(caplog, monkeypatch, tmp_path) -> list[str]:
    import logging
    from pathlib import Path

    for variable in ("AREAL_TINY_DIR", "AREAL_TINY_CALCULATOR_DIR", "AREAL_TINY_VISION_DIR", "AREAL_DATA_DIR"):
        monkeypatch.setenv(variable, str(tmp_path))
    recipe = Path(__file__).resolve().parents[2] / "recipes" / "grpo_cpu_async.yaml"
    with caplog.at_level(logging.INFO):
        assert cli.main(["check", str(recipe), "--nodes", "1", "--gpus-per-node", "2"]) == 0
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_check_warns_when_the_declared_cluster_answers_without_a_token(caplog, monkeypatch, tmp_path):
    asked: list[str] = []
    monkeypatch.setattr(cluster_env, "accepts_without_token", lambda address: asked.append(address) or True)
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.2:6379")
    warnings = check_cpu_recipe(caplog, monkeypatch, tmp_path)
    assert asked == ["10.0.0.2:6379"]
    assert any("the Ray cluster at 10.0.0.2:6379 accepts a client that sends no token" in w for w in warnings)


def test_check_asks_no_cluster_when_none_is_declared(caplog, monkeypatch, tmp_path):
    def never(address):
        raise AssertionError(f"probed {address}")

    monkeypatch.setattr(cluster_env, "accepts_without_token", never)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert not [
        w for w in check_cpu_recipe(caplog, monkeypatch, tmp_path) if "RAY_AUTH_MODE" in w or "sends no token" in w
    ]


def test_the_probe_sends_no_token_whatever_this_shell_sets(monkeypatch):
    import subprocess

    seen = {}

    def run(command, env, **kwargs):
        seen.update(env=env, gcs=command[3])
        return subprocess.CompletedProcess(command, 0, stdout="OPEN\n")

    monkeypatch.setattr(subprocess, "run", run)
    monkeypatch.setenv("RAY_AUTH_TOKEN", "secret")
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    assert cluster_env.accepts_without_token("10.0.0.2:6379") is True
    assert seen["gcs"] == "10.0.0.2:6379" and seen["env"]["RAY_AUTH_MODE"] == "disabled"
    assert "RAY_AUTH_TOKEN" not in seen["env"]
    assert cluster_env.accepts_without_token("ray://10.0.0.2:10001") is None  # Ray Client: not a GCS address
