"""The benchmarks' engine stand-in is not ours: a backend only where the bench registers it (tools/areal_bench)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from areal_plugins.rollout import verl_registration

TOOLS = Path(__file__).resolve().parents[2] / "tools"


def test_the_package_knows_only_its_own_engine_and_says_how_another_is_added():
    assert verl_registration.backends() == {"areal_cpu": "areal_plugins.rollout.cpu.server:CPURolloutServer"}
    known = r"unknown .* 'areal_paced'; known in this process: areal_cpu .*register_backend"
    with pytest.raises(ValueError, match=known):
        verl_registration.server_class("areal_paced")


def test_the_bench_registers_its_paced_engine(paced_backend):
    assert verl_registration.server_class(paced_backend).__name__ == "VerlPacedServer"
    assert set(verl_registration.backends()) == {"areal_cpu", "areal_paced"}


def test_a_name_served_by_another_class_is_refused(monkeypatch):
    monkeypatch.setattr(verl_registration, "BACKENDS", dict(verl_registration.BACKENDS))
    verl_registration.register_backend("areal_cpu", verl_registration.BACKENDS["areal_cpu"])  # the same: no-op
    served = r"'areal_cpu' is served by areal_plugins\.rollout\.cpu\.server:CPURolloutServer already"
    with pytest.raises(ValueError, match=served):
        verl_registration.register_backend("areal_cpu", "other:Server")


def test_the_real_engine_needs_no_registration():
    assert verl_registration.server_class("areal_cpu").__name__ == "CPURolloutServer"


def test_the_runs_environment_and_job_carry_the_bench():
    import areal_bench

    env = areal_bench.run_environment({"PYTHONPATH": "/x", "VERL_USE_EXTERNAL_MODULES": "mine"})
    assert env["PYTHONPATH"] == os.pathsep.join([str(TOOLS), "/x"])
    assert env["VERL_USE_EXTERNAL_MODULES"] == "mine,areal_bench.verl_backend"
    assert areal_bench.run_environment(env) == env  # named once
    assert areal_bench.run_overrides({}) == [
        f"++ray_kwargs.ray_init.runtime_env.py_modules=['{TOOLS / 'areal_bench'}']",
        "++ray_kwargs.ray_init.runtime_env.env_vars.VERL_USE_EXTERNAL_MODULES='areal_bench.verl_backend'",
    ]
    # verl's rows also record each trained token's version (tools/areal_bench/verl_token_versions.py); ours never
    recording = "areal_bench.verl_backend,areal_bench.verl_token_versions"
    assert areal_bench.run_overrides({}, token_versions=True)[1].endswith(f"VERL_USE_EXTERNAL_MODULES='{recording}'")
    assert areal_bench.run_environment(env, token_versions=True)["VERL_USE_EXTERNAL_MODULES"] == f"mine,{recording}"
