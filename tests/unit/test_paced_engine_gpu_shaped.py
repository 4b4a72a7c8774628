"""The GPU-shaped paced engine (``engine_kwargs.areal_paced.case``) and the time scale that sizes it to the trainer.

Times are real (the engine sleeps on the event loop's clock): each test derives its expectation by hand, asserts it
as a lower bound to 10 ms (a timer never fires early) and leaves the upper side generous for a loaded machine. The toy
decode cost: a step takes 20 ms plus 20 ms per running answer, a prefill 20 ms per token, nothing per cached token.
"""

from __future__ import annotations

import asyncio
import math
import time
from statistics import NormalDist

import pytest
from areal_bench import gpu_shaped
from areal_bench.paced_engine import GpuShapedDecode, PacedRolloutServer, VerlPacedServer, gpu_shaped_pacer

from areal_plugins.planning.cluster_sim import Cluster, Workload
from areal_plugins.planning.hardware import GPU, DecodeCost, Efficiency, ModelShape

#: step_s(R, C) = 0.02 + 0 + R x 2 x 1 / 100 = 0.02 + 0.02·R; prefill_s(n) = 2 x 1 x n / 100 = 0.02·n.
TOY_COST = DecodeCost(
    step_latency=0.02, weight_bytes=0, kv_bytes_per_token=0, matmul_params=1, attention_width=0, bandwidth=1, flops=100
)
EARLY = 0.01  # a timer may fire this much early on the loop's clock resolution, and no more
LATE = 0.5  # what a loaded 2-core box may add (load average 6 measured while these ran)


def toy_engine(length: int, capacity: float = 1e9, time_scale: float = 1.0) -> PacedRolloutServer:
    """A paced server whose every answer is ``length`` tokens (σ = 0) on the toy cost."""
    pacer = GpuShapedDecode(TOY_COST, capacity, time_scale, log_mu=math.log(length), log_sigma=0.0)
    return PacedRolloutServer(pacer=pacer, response_length=10_000)


async def timed(coroutine):
    loop = asyncio.get_running_loop()
    started = loop.time()
    result = await coroutine
    return result, loop.time() - started


# ---------------------------------------------------------------------- one step-time function


def test_the_stand_in_and_the_planner_call_the_same_step_time(monkeypatch):
    """Patch DecodeCost.step_s: the planner's engine and the stand-in of the paper's 1.5B both change with it."""
    pacer = gpu_shaped_pacer("paper-1.5b", time_scale=1.0, length_scale=1 / 64)
    planner_engine = gpu_shaped.case("paper-1.5b").cluster.engine()
    assert pacer.cost == planner_engine.decode
    monkeypatch.setattr(DecodeCost, "step_s", lambda self, running, context: 0.05)
    assert planner_engine.step_base(3, 100.0) == 0.05
    pacer.log_mu, pacer.log_sigma = math.log(4), 0.0  # 4-token answers, no prompt: 4 steps of 0.05 s, no prefill
    server = PacedRolloutServer(pacer=pacer)
    out, took = asyncio.run(timed(server.generate([], {}, "r")))
    assert len(out.token_ids) == 4
    # The 1.5B's KV growth is 8.6e-9 s per token and step: nothing next to 0.2 s.
    assert 0.2 - EARLY <= took < 0.2 + LATE


def test_the_paper_1_5b_step_by_hand():
    """R1-Distill-Qwen-1.5B on an H800 at the planner's fit (82 µs per layer, 17.9% of the FLOPs):

    attention 2·1536·12·128 + 2·1536·2·128 = 5,505,024; MLP 3·1536·8960 = 41,287,680 -> 46,792,704 a layer;
    x 28 + the 151,936 x 1536 head = 1,543,569,408 matmul parameters; weights 2 x (28 x 46,792,704 + 2 x
    151,936 x 1536) = 3,553,886,208 B; KV 2 x 28 x 2 x 128 x 2 = 28,672 B a token.
    floor = 28 x 82 µs + 3,553,886,208 / 3.35e12 = 3.3569 ms; each answer 2 x 1,543,569,408 / (989e12 x 0.179)
    = 17.44 µs; doubling 64 answers to 128 past the floor adds 64 x 17.44 µs = 1.116 ms, and their cached tokens
    (1000 each) 64,000 x 28,672 / 3.35e12 = 0.548 ms.
    """
    engine = gpu_shaped.case("paper-1.5b").cluster.engine()
    floor = 28 * 82e-6 + 3_553_886_208 / 3.35e12
    per_answer = 2 * 1_543_569_408 / (989e12 * 0.179)
    assert engine.step_base(0, 0) == pytest.approx(floor, rel=1e-9)
    assert engine.step_base(64, 64_000) == pytest.approx(floor + 64 * per_answer + 64_000 * 28_672 / 3.35e12, rel=1e-9)
    doubled = engine.step_base(128, 128_000) - engine.step_base(64, 64_000)
    assert doubled == pytest.approx(1.116e-3 + 0.548e-3, rel=2e-3)


def test_doubling_the_running_answers_slows_each_step_as_the_formula_says():
    """Toy cost: 2 answers of 10 tokens (1-token prompts): prefill 2 x 0.02 = 0.04 s, then 10 steps of
    0.02 + 2 x 0.02 = 0.06 s: 0.64 s. Four: 0.08 + 10 x 0.10 = 1.08 s (the floor alone would keep 0.64 s)."""

    async def batch(answers: int) -> float:
        server = toy_engine(10)
        outs, took = await timed(asyncio.gather(*(server.generate([i], {}, f"r{i}") for i in range(answers))))
        assert [len(out.token_ids) for out in outs] == [10] * answers
        return took

    two, four = asyncio.run(batch(2)), asyncio.run(batch(4))
    assert 0.64 - EARLY <= two < 0.64 + LATE
    assert 1.08 - EARLY <= four < 1.08 + LATE


# ---------------------------------------------------------------------- KV capacity


def test_answers_beyond_the_kv_capacity_queue_until_one_finishes():
    """Capacity 30 tokens, answers of 1-token prompts + 10 tokens hold 11 each: two run, the third queues.
    The two: prefill 0.04 s + 10 x 0.06 = 0.64 s. The third then runs alone: prefill 0.02 + 10 x 0.04 = 0.42 s,
    done at 1.06 s (admitted with the others all three would be done at 0.86 s: 0.06 + 10 x 0.08 s)."""

    async def scenario():
        server = toy_engine(10, capacity=30)
        loop = asyncio.get_running_loop()
        started = loop.time()
        ends: dict[str, float] = {}

        async def one(i: int) -> None:
            await server.generate([i], {}, f"r{i}")
            ends[f"r{i}"] = loop.time() - started

        tasks = [asyncio.create_task(one(i)) for i in range(3)]
        await asyncio.sleep(0.1)
        assert (len(server.pacer.running), len(server.pacer.queue)) == (2, 1)
        assert (await server.get_stats())["in_flight"] == 3
        await asyncio.gather(*tasks)
        return ends

    ends = asyncio.run(scenario())
    assert 0.64 - EARLY <= ends["r0"] < 0.64 + LATE and 0.64 - EARLY <= ends["r1"] < 0.64 + LATE
    assert 1.06 - EARLY <= ends["r2"] < 1.06 + LATE


# ---------------------------------------------------------------------- lengths


def test_answer_lengths_follow_the_papers_log_normal_scaled_down():
    """The paper's 1.5B workload (mean 2,117 tokens, 0.5% above 27,648) is log-normal with
    σ = z - sqrt(z² - 2 ln(27,648 / 2,117)), z = Φ⁻¹(0.995), and μ = ln 2,117 - σ²/2; at length_scale 1/8 its
    median is e^μ / 8 and its 90th percentile e^(μ + 1.2816 σ) / 8. Of 20,000 draws the share below each is
    within 4 standard errors (sqrt(p(1-p)/n): 0.0035 at the median, 0.0021 at the 90th) of its probability,
    and the share at the scaled cap (27,648 / 8 = 3,456) within 4 of 0.005 (0.0005)."""
    z = NormalDist().inv_cdf(0.995)
    sigma = z - math.sqrt(z * z - 2 * math.log(27_648 / 2_117))
    mu = math.log(2_117) - sigma * sigma / 2
    pacer = gpu_shaped_pacer("paper-1.5b", time_scale=1.0, length_scale=1 / 8, seed=11)
    n = 20_000
    draws = [pacer.draw(cap=3_456) for _ in range(n)]
    assert max(draws) == 3_456 and min(draws) >= 1
    median, p90 = math.exp(mu) / 8, math.exp(mu + NormalDist().inv_cdf(0.9) * sigma) / 8
    assert median == pytest.approx(106.0, abs=0.1)  # e^μ = 848: the tail drags the mean 2.5x above the median
    assert sum(d <= median for d in draws) / n == pytest.approx(0.5, abs=4 * 0.0035)
    assert sum(d <= p90 for d in draws) / n == pytest.approx(0.9, abs=4 * 0.0021)
    assert sum(d == 3_456 for d in draws) / n == pytest.approx(0.005, abs=4 * 0.0005)
    # Seeded: the same seed draws the same answers, another seed others.
    again = gpu_shaped_pacer("paper-1.5b", time_scale=1.0, length_scale=1 / 8, seed=11)
    other = gpu_shaped_pacer("paper-1.5b", time_scale=1.0, length_scale=1 / 8, seed=12)
    assert [again.draw(3_456) for _ in range(50)] == draws[:50] != [other.draw(3_456) for _ in range(50)]


def test_an_answer_never_runs_past_its_requests_budget():
    server = toy_engine(length=50)
    out = asyncio.run(server.generate([1], {"max_tokens": 3}, "r"))
    assert (len(out.token_ids), out.stop_reason) == (3, "completed")


# ---------------------------------------------------------------------- interruption


def test_a_continued_request_prefills_its_prompt_and_partial_output_and_finishes_the_same_answer():
    """A 20-token answer of a 2-token prompt, running alone: prefill 0.04 s, then 0.04 s a token; aborted at
    0.25 s it holds p = 5 tokens ((0.25 - 0.04) / 0.04 = 5.25; a late wake-up may make it more). Continued (the
    client re-sends the 2 + p tokens under the same id, asking for up to 20 - p more) it decodes the other 20 - p
    after recomputing the 2 + p tokens' cache: (2 + p) x 0.02 + (20 - p) x 0.04 s (p = 5: 0.74 s, 0.60 without
    the prefill)."""

    async def scenario():
        server = toy_engine(20)
        first = asyncio.create_task(server.generate([1, 2], {}, "a"))
        await asyncio.sleep(0.25)
        await server.abort_request("a")
        partial = await first
        assert partial.stop_reason == "aborted"
        p = len(partial.token_ids)
        resumed, took = await timed(server.generate([1, 2, *partial.token_ids], {"max_tokens": 20 - p}, "a"))
        return p, resumed, took

    p, resumed, took = asyncio.run(scenario())
    assert 5 <= p <= 12
    assert (len(resumed.token_ids), resumed.stop_reason) == (20 - p, "completed")
    expected = (2 + p) * 0.02 + (20 - p) * 0.04
    assert expected - EARLY <= took < expected + LATE


def test_a_new_request_under_another_id_draws_a_new_answer():
    """Only a continuation (same id, after an abort) finishes the old answer: 30 tokens (σ = 0) for each new id."""

    async def scenario():
        server = toy_engine(30, time_scale=0.1)  # 4 ms a token
        first = asyncio.create_task(server.generate([1], {}, "a"))
        await asyncio.sleep(0.02)
        await server.abort_request("a")
        partial = await first
        fresh = await server.generate([1, *partial.token_ids], {}, "b")
        again = await server.generate([1], {}, "a")  # "a" continued: the rest of its 30
        return len(partial.token_ids), len(fresh.token_ids), len(again.token_ids)

    p, fresh, again = asyncio.run(scenario())
    assert 0 < p < 30 and fresh == 30 and again == 30 - p


def test_an_abort_of_every_request_returns_each_ones_partial_output():
    """abort_all_requests (a weight update): two 20-token answers running together (capacity 45 tokens: a third,
    queued behind them, never starts) are cut at the same step, the third with nothing."""

    async def scenario():
        server = toy_engine(20, capacity=45)
        tasks = [asyncio.create_task(server.generate([i], {}, f"r{i}")) for i in range(3)]
        await asyncio.sleep(0.25)  # prefill 0.04 s, then 0.06 s a step: 3.5 steps
        await server.abort_all_requests()
        outs = await asyncio.gather(*tasks)
        await server.resume_generation()
        return outs, await server.get_stats()

    outs, stats = asyncio.run(scenario())
    p = len(outs[0].token_ids)
    assert 3 <= p < 20
    assert [(len(o.token_ids), o.stop_reason) for o in outs] == [(p, "aborted"), (p, "aborted"), (0, "aborted")]
    assert (stats["generated_tokens"], stats["in_flight"]) == (2 * p, 0)


# ---------------------------------------------------------------------- CPU


def test_the_stand_in_does_no_work_per_token():
    """400 answers of the paper's lengths at 1/8 (mean 265 tokens: ~100k tokens) on the 1.5B's decode model at
    time scale 1/20: the batch loop turns once per event (an arrival, a finish; a late timer may add a turn),
    never once per token. Counted, not timed: a CPU-time bound decided by the machine's load failed CI once
    (4 µs a token on a busy box against 0.2-0.5 µs on a quiet one). A pacer with a timer per token turns ~100k
    times here."""

    async def scenario() -> tuple[int, int]:
        pacer = gpu_shaped_pacer("paper-1.5b", time_scale=5e-2, length_scale=1 / 8, seed=3)
        server = PacedRolloutServer(pacer=pacer, response_length=3_456)
        outs = await asyncio.gather(*(server.generate([i % 500], {}, f"r{i}") for i in range(400)))
        return sum(len(out.token_ids) for out in outs), pacer.wakeups

    started = time.monotonic()
    tokens, wakeups = asyncio.run(scenario())
    assert tokens > 50_000 and time.monotonic() - started > 0.3  # paced, not instant
    # Events: 400 arrivals and 400 finishes (admissions ride on them), with a margin for late timers' extra turns.
    assert wakeups <= 4 * 800, f"{wakeups} turns of the batch loop for {tokens} tokens"


# ---------------------------------------------------------------------- as verl builds it


def test_verls_replica_builds_the_gpu_shaped_engine_from_its_engine_kwargs(paced_backend):
    from omegaconf import OmegaConf

    from areal_plugins.rollout.verl_registration import engine_options

    kwargs = {"case": "paper-1.5b", "time_scale": 10.0, "length_scale": 0.125, "kv_capacity_tokens": 500}
    rollout = OmegaConf.create({"name": "areal_paced", "engine_kwargs": {"areal_paced": kwargs}})
    options = engine_options(rollout)
    common = {"model_path": "unused", "response_length": 432, "max_model_len": 464, "seed": 5, "num_threads": 2}
    server = VerlPacedServer(**common, **options)
    assert isinstance(server.pacer, GpuShapedDecode) and server.tokens_per_s is None
    assert (server.pacer.time_scale, server.pacer.kv_capacity_tokens) == (10.0, 500)
    # The replica's seed (rollout.seed + rank) seeds the lengths.
    same = VerlPacedServer(**common, **options)
    other = VerlPacedServer(**{**common, "seed": 6}, **options)
    first = [server.pacer.draw(432) for _ in range(20)]
    assert first == [same.pacer.draw(432) for _ in range(20)] != [other.pacer.draw(432) for _ in range(20)]
    # Without a case: the fixed-rate engine, as before.
    assert VerlPacedServer(**common).tokens_per_s == 100.0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"case": "paper-70b"}, r"areal_paced\.case: unknown GPU case 'paper-70b'; choose one of paper-1\.5b"),
        ({"case": "paper-1.5b", "tokens_per_s": 50}, r"tokens_per_s is the fixed-rate engine's .* drop one"),
        ({"time_scale": 2.0}, r"time_scale pace a GPU case: set .*areal_paced\.case too"),
        ({"case": "paper-1.5b", "length_scale": 2.0}, r"areal_paced\.length_scale must be in \(0, 1\]"),
        ({"case": "paper-1.5b", "time_scale": 0}, r"areal_paced\.time_scale must be a number above 0, got 0"),
    ],
)
def test_a_gpu_shaped_setting_it_cannot_honour_is_refused_naming_the_key(kwargs, message):
    with pytest.raises(ValueError, match=message):
        VerlPacedServer(model_path="unused", response_length=8, max_model_len=40, **kwargs)


# ---------------------------------------------------------------------- the time scale


#: A toy cluster whose synchronous step is worked out by hand (tests/unit/test_planning.py's toy): 288 B of
#: weights read at 288 B/s (1 s a step), 16 B of KV a token, 128 matmul parameters, 9,120 FLOP/s.
TOY = ModelShape("toy", hidden=4, layers=1, heads=1, kv_heads=1, intermediate=4, vocab=4)
TOY_GPU = GPU("toy", memory_bandwidth=288.0, bf16_flops=9120.0, memory=1e9)


def test_the_time_scale_makes_the_boxs_step_divide_as_the_cases():
    """Case: one GPU, one group of two 6-token answers, no prompt. Generation: 6 steps of 1 s + 2 x 2 x 128 / 9120 s
    compute, the cache adding 2 x 16 / 288 = 1/9 s a step: 6 + 6 x 512/9120 + (1/9) x 6²/2 = 8.3368 s; training
    5 passes x 2 x (2·128·6 + 2·4·36) = 18,240 FLOPs = 2 s, + 288 B of weights at 64 GB/s.
    Box: the same group at length_scale 1/2 (3-token answers): 3 + 3 x 512/9120 + (1/9) x 9/2 = 3.6684 s at
    scale 1. A measured 5 s trainer step: time_scale = (8.3368 / 2) x 5 / 3.6684 = 5.6815."""
    case_work = Workload(batch=1, group=2, prompt=0, log_mu=math.log(6), log_sigma=0.0, max_response=100)
    toy_case = gpu_shaped.GpuCase(
        "toy", "by hand", Cluster(TOY_GPU, TOY, Efficiency(1.0, 1.0), gpus=1), case_work, sync_generating_gpus=None
    )
    scale = gpu_shaped.time_scale_for(toy_case, 5.0, gpu_shaped.StandInShape(1, 2, 0, 0.5), steps=3)
    case_generate = 6 + 6 * 512 / 9120 + 36 / 18
    box_generate = 3 + 3 * 512 / 9120 + 9 / 18
    assert scale.case_generate_s == pytest.approx(case_generate, abs=1e-6)
    assert scale.case_train_s == pytest.approx(2 + 288 / 64e9, abs=1e-9)
    assert scale.stand_in_generate_s == pytest.approx(box_generate, abs=1e-6)
    assert scale.time_scale == pytest.approx(case_generate / 2 * 5 / box_generate, rel=1e-6)
    assert scale.time_scale == pytest.approx(5.6815, rel=1e-4)
    assert "time scale 5.68" in scale.describe()
    with pytest.raises(ValueError, match="trainer's step must be a positive number of seconds"):
        gpu_shaped.time_scale_for(toy_case, 0.0, gpu_shaped.StandInShape(1, 2, 0, 0.5))


def test_the_paper_1_5b_generates_four_times_as_long_as_it_trains():
    """The planner's paper case (fitted to 147.6 s a synchronous step, docs/simulator.md): most of the step is the
    wait for the longest answer. Its split is the planner's, not ours to pin: asserted only as generation-bound."""
    scale = gpu_shaped.time_scale_for(
        gpu_shaped.case("paper-1.5b"), 3.0, gpu_shaped.StandInShape(16, 8, 20, 1 / 64), steps=50
    )
    assert scale.case_generate_s + scale.case_train_s == pytest.approx(147.6, rel=0.03)
    assert scale.ratio > 2
    assert scale.time_scale * scale.stand_in_generate_s == pytest.approx(scale.ratio * 3.0, rel=1e-9)
