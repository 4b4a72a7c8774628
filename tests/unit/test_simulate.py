"""The discrete-event simulator (tools/simulate.py) against timelines worked out by hand."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from tests.unit.tool_scripts import load_tool

simulate = load_tool("simulate")

#: One group of one 10-token response per step, no prompt: generating it takes 1 s (10 tok/s, one slot),
#: training it 1 s (10 tok/s, no fixed cost, no gain from a second device), no interrupt cost.
WORKLOAD = simulate.Workload(steps=4, batch=1, group=1, length_median=10, length_sigma=0.0, length_max=10, prompt_len=0)
HARDWARE = simulate.Hardware(
    devices=2, rollout_devices=1, slots=1, decode_tps=10, overhead_s=0.0, train_tps=10, train_fixed_s=0.0,
    interrupt_s=0.0, train_scaling=0.0,
)  # fmt: skip


def test_sync_steps_generate_then_train():
    run = simulate.simulate_sync(WORKLOAD, HARDWARE)
    assert run["step_ends"] == pytest.approx([2, 4, 6, 8])  # 1 s generation + 1 s training, 4 times
    assert run["tokens"] == 40


def test_eta_zero_is_synchronous_and_a_large_eta_pipelines():
    # η = 0: each step's group is admitted only after the previous update, so nothing overlaps: 2 s a step.
    assert simulate.simulate_async(WORKLOAD, HARDWARE, eta=0)["step_ends"] == pytest.approx([2, 4, 6, 8])
    # η = 8: nine groups are admitted at t = 0 and finish at 1, 2, ..., 9 s on the one slot; training takes
    # group k at k s and is done at k + 1 s: steps end at 2, 3, 4, 5.
    run = simulate.simulate_async(WORKLOAD, HARDWARE, eta=8)
    assert run["step_ends"] == pytest.approx([2, 3, 4, 5])
    # After step 1 the bench's count: sync 6 s vs async 3 s for 30 tokens -> 2x, the overlap bound.
    sync_cost = simulate.s_per_1k_tokens_after_first(simulate.simulate_sync(WORKLOAD, HARDWARE))
    assert sync_cost / simulate.s_per_1k_tokens_after_first(run) == pytest.approx(2.0)


def test_staleness_is_bounded_by_eta():
    slow_rollout = replace(HARDWARE, decode_tps=5)  # generation 2 s, training 1 s: the trainer waits
    for eta in (0, 1, 2, 4):
        run = simulate.simulate_async(replace(WORKLOAD, steps=12), slow_rollout, eta=eta)
        assert run["staleness_mean"] <= eta


def test_lognormal_fit_recovers_mean_and_tail():
    count = 128
    median, sigma = simulate.lognormal_from_mean_and_max(mean=12.0, expected_max=60.0, count=count)
    z = simulate.statistics.NormalDist().inv_cdf(1 - 1 / (count + 1))
    assert median * math.exp(sigma**2 / 2) == pytest.approx(12.0)
    assert median * math.exp(sigma * z) == pytest.approx(60.0)
    assert simulate.lognormal_from_mean_and_max(5.0, 5.0, count) == pytest.approx((5.0, 0.0))  # no tail


def bench_json(gen_s: float, train_s: float) -> dict:
    def cell(value: float) -> dict:
        return {"median": value, "min": value, "max": value, "n": 1}

    sync = {"s_per_1k_tokens": 4.0, "response_len_max": 40.0}
    return {
        "steps_per_run": 6,
        "rows": [
            {
                "config": "sync",
                "trajectories_per_step": cell(128),
                "response_len_mean": cell(12.0),
                "response_len_max": cell(40.0),
                "prompt_len_mean": cell(17.0),
                "gen_s_median": cell(gen_s),
                "train_s_median": cell(train_s),
                "s_per_1k_tokens": cell(4.0),
            }
        ],
        "runs": {"sync": [sync]},
    }


def test_calibration_reproduces_the_measured_sync_phases():
    workload, hw = simulate.calibrate_from_bench(bench_json(gen_s=9.0, train_s=7.0))
    assert (workload.batch, workload.group, workload.prompt_len, workload.length_max) == (16, 8, 17, 40)
    run = simulate.simulate_sync(replace(workload, steps=1), hw)  # seed 0: the lengths the fit used
    assert run["gen_s"] == pytest.approx(9.0, rel=1e-3)
    assert run["train_s"] == pytest.approx(7.0, rel=1e-3)


def test_shared_cores_limit_is_cpu_work_over_cores():
    # Sync spends 8 CPU-s per 1k tokens; async skips a quarter of it (the old-log-prob pass) and pays one
    # more 0.1 CPU-s overhead for each of the 30% interrupted trajectories of 40 tokens (25 per 1k
    # tokens): 6 + 0.3 x 0.1 x 25 = 6.75 CPU-s per 1k tokens on 2 cores: 3.375 s.
    assert simulate.shared_cores_s_per_1k(8.0, 0.75, 0.3, 0.1, 40.0, 2) == pytest.approx(3.375)
    assert simulate.machine_cores({"machine": "vm: x86_64, 2 CPUs, no GPU"}) == 2
    with pytest.raises(SystemExit, match="how many CPUs"):
        simulate.machine_cores({"machine": "unknown"})
