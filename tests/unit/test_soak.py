"""The soak script's memory arithmetic (tools/soak.py): which process grew, and how fast."""

from __future__ import annotations

import pytest

from tests.unit.tool_scripts import load_tool

soak = load_tool("soak")


def test_actor_processes_are_grouped_by_role_not_by_the_method_they_run():
    assert soak.role("ray::WorkerDict.actor_rollout_update_actor") == "ray::WorkerDict"
    assert soak.role("ray::WorkerDict") == "ray::WorkerDict"
    assert soak.role("gcs_server") == "gcs_server"


def test_pss_per_cycle_takes_each_roles_median_between_kills():
    samples = [
        {"t_s": 5, "pss_by_process": {"gcs_server": 1.0}},  # before the first kill: not in a cycle
        {"t_s": 10, "pss_by_process": {"gcs_server": 10.0, "ray::W.a": 5.0}},
        {"t_s": 20, "pss_by_process": {"gcs_server": 12.0, "ray::W.b": 7.0}},
        {"t_s": 30, "pss_by_process": {"gcs_server": 30.0, "ray::W.a": 6.0, "ray::W.b": 1.0}},  # 7 MB as W
    ]
    per_cycle = soak.pss_per_cycle(samples, kills=[10, 30, 40])
    assert per_cycle == {"gcs_server": [11.0, 30.0], "ray::W": [6.0, 7.0]}


def test_growing_skips_the_warm_up_cycle_and_reports_mb_per_hour():
    kills = [0, 600, 1200, 1800, 2400]  # cycles start every 10 minutes
    per_cycle = {
        "leaky": [100, 200, 210, 220],  # +10 MB per 10 min after warm-up: 60 MB/h
        "warm_then_flat": [100, 300, 300, 300],
        "slow": [100, 100, 101, 102],  # 6 MB/h: under the 20 MB/h threshold
    }
    assert soak.growing(per_cycle, kills) == pytest.approx({"leaky": 60.0})


def test_tree_pss_counts_each_role_once_per_cycle_and_its_slope_skips_warm_up():
    report = {
        "pss_mb_per_cycle": {"a": [10.0, 20.0, 21.0, 22.0], "b": [5.0, 5.0, 5.0, 5.0]},
        "server_kills": [0, 3600, 7200, 10800, 14400],  # hourly cycles
    }
    soak.add_pss_totals(report)
    assert report["pss_total_mb_per_cycle"] == [15.0, 25.0, 26.0, 27.0]
    assert report["pss_total_slope_mb_per_hour_after_warmup"] == pytest.approx(1.0)  # 25, 26, 27 an hour apart
    assert report["growing_processes_mb_per_hour"] == {}  # 1 MB/h is under the 20 MB/h threshold
