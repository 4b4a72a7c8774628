"""The simulator with a measured trainer (``train_time``, ``weight_load_s``) and the colocated asynchronous mode:
the inputs the bench's planner comparison gives it. Expected values are derived by hand from one engine decoding
answers of one fixed length."""

from __future__ import annotations

import math

import pytest
from areal_bench.paper import paper_cluster

from areal_plugins.planning.cluster_sim import Workload, simulate_async, simulate_sync
from areal_plugins.planning.plan import PAPER_FIT

LENGTH, PROMPT = 1000, 100


def one_engine_cluster(rollout_engines: int = 1):
    cluster = paper_cluster(PAPER_FIT)
    tp = cluster.engine().tensor_parallel
    from dataclasses import replace

    return replace(cluster, gpus=(rollout_engines + 1) * tp, rollout_gpus=rollout_engines * tp)


def fixed_lengths(batch: int = 1) -> Workload:
    """Every answer exactly LENGTH tokens (σ = 0): a step's generation is one number."""
    return Workload(
        batch=batch, group=1, response_mean=LENGTH, max_response=10 * LENGTH, prompt=PROMPT,
        log_mu=math.log(LENGTH), log_sigma=0.0,
    )  # fmt: skip


def decode_s(cluster, running: int = 1) -> float:
    """One answer's prefill and decode on the engine: the hand count the simulator must reproduce."""
    engine = cluster.engine()
    return engine.prefill_time(PROMPT * running, PROMPT * PROMPT * running) + engine.time_for_steps(
        running, PROMPT * running, LENGTH
    )


def test_sync_with_a_measured_trainer_costs_generation_plus_the_given_seconds_and_load():
    cluster = one_engine_cluster()
    run = simulate_sync(cluster, fixed_lengths(), steps=4, train_time=lambda lengths: 7.0, weight_load_s=0.5)
    assert run.train_s == [7.0] * 4
    assert run.generate_s == pytest.approx([decode_s(cluster)] * 4, rel=1e-6)
    gaps = [b - a for a, b in zip([0.0, *run.step_ends], run.step_ends, strict=False)]
    assert gaps == pytest.approx([decode_s(cluster) + 7.0 + 0.5] * 4, rel=1e-6)


def test_the_train_time_receives_each_sequences_tokens():
    seen = []
    simulate_sync(one_engine_cluster(), fixed_lengths(batch=3), steps=1, train_time=lambda x: seen.append(x) or 1.0)
    assert seen == [[float(PROMPT + LENGTH)] * 3]


def test_separate_async_is_bound_by_the_trainer_when_it_is_the_slower_side():
    cluster = one_engine_cluster()
    train = 10 * decode_s(cluster, running=2)  # the engine is far ahead: each step costs the trainer's seconds
    run = simulate_async(cluster, fixed_lengths(), eta=1, steps=8, train_time=lambda x: train, weight_load_s=0.0)
    assert run.step_s(warmup=2) == pytest.approx(train, rel=1e-6)


def test_colocated_async_engines_sleep_while_the_trainer_computes():
    """Separate, the engine decodes through training; colocated, it stops: each step costs the trainer's seconds
    plus what was left to decode. With η = 0 one answer is in flight: step = prefill + decode + train, as sync's."""
    cluster = one_engine_cluster()
    train = 3 * decode_s(cluster)
    kwargs = {"steps": 6, "train_time": lambda x: train, "weight_load_s": 0.0}
    colocated = simulate_async(cluster, fixed_lengths(), eta=0, colocated=True, **kwargs)
    assert colocated.step_s(warmup=2) == pytest.approx(decode_s(cluster) + train, rel=1e-6)
    # η = 1, separate: the next answers decode beside training, which alone sets the pace.
    separate = simulate_async(cluster, fixed_lengths(), eta=1, **kwargs)
    assert separate.step_s(warmup=2) == pytest.approx(train, rel=1e-6)
    # Colocated: two answers decode together (nothing during training), then two steps train back to back while
    # the next two wait asleep (submitted, not decoded): two steps per two-answer decode + 2 x train (to 1e-3: the
    # two answers' prefills start apart by one admission, which the hand count merges).
    colocated = simulate_async(cluster, fixed_lengths(), eta=1, colocated=True, **kwargs)
    assert colocated.step_s(warmup=2) == pytest.approx((decode_s(cluster, running=2) + 2 * train) / 2, rel=1e-3)


def test_a_smaller_kv_cache_bounds_what_runs_and_slows_generation():
    """Capacity for two answers (prompt + answer each 1,100 tokens): four answers decode two at a time, so the
    step's generation is two rounds of two, where the full cache runs all four in one."""
    from dataclasses import replace

    cluster = one_engine_cluster()
    cluster = replace(cluster, gpus=cluster.rollout_gpus, rollout_gpus=0)  # sync: every GPU generates; one engine
    small = replace(cluster, kv_capacity_tokens=2 * (PROMPT + LENGTH))
    assert small.engine().kv_capacity_tokens == 2 * (PROMPT + LENGTH)
    assert cluster.engine().kv_capacity_tokens > 1e5  # the H800's cache: everything fits
    work = fixed_lengths(batch=4)
    full = simulate_sync(cluster, work, steps=1, train_time=lambda x: 1.0, weight_load_s=0.0).generate_s[0]
    bounded = simulate_sync(small, work, steps=1, train_time=lambda x: 1.0, weight_load_s=0.0).generate_s[0]
    assert full == pytest.approx(decode_s(cluster, running=4), rel=1e-6)
    assert bounded == pytest.approx(2 * decode_s(cluster, running=2), rel=1e-6)
