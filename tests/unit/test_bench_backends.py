"""The benchmarks' engine stand-in is there only where a benchmark asks for it (``AREAL_BENCH_BACKENDS=1``)."""

from __future__ import annotations

import pytest

from areal_plugins.rollout import verl_registration


def test_a_run_that_names_the_paced_engine_without_opting_in_is_told_how(monkeypatch):
    monkeypatch.delenv(verl_registration.BENCH_ENV, raising=False)
    assert "areal_paced" not in verl_registration.backends()
    with pytest.raises(ValueError, match="AREAL_BENCH_BACKENDS=1"):
        verl_registration.server_class("areal_paced")


def test_a_benchmark_that_opts_in_gets_the_paced_engine(monkeypatch):
    monkeypatch.setenv(verl_registration.BENCH_ENV, "1")
    assert verl_registration.server_class("areal_paced").__name__ == "VerlPacedServer"
    assert set(verl_registration.backends()) == {"areal_cpu", "areal_paced"}


def test_the_real_engine_needs_no_opt_in(monkeypatch):
    monkeypatch.delenv(verl_registration.BENCH_ENV, raising=False)
    assert verl_registration.server_class("areal_cpu").__name__ == "CPURolloutServer"
