"""Benchmark: the reward service with a slow verifier — throughput by worker count, and overlap with generation.

1. **Throughput**: 64 rewards scored by concurrent callers through :class:`RewardService` with 1..N worker
   processes. The verifier is math-verify plus a fixed delay (a slow checker: a sandbox, a remote judge);
   the delay is a sleep, so on 2 cores the workers' gain shows what parallel scoring buys when the
   verifier waits, not when it computes.
2. **Overlap**: the ``areal_cpu`` engine generates 64 long-tailed responses; rewards are either started as
   each response finishes (what verl's reward loop + our service do) or all after generation ends. Wall
   time until the last reward.

Run: ``.venv/bin/python tools/bench_reward.py --repeats 3 --out runs/bench_reward.json`` (~4 min)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from areal_plugins.rewards.math_verify_reward import compute_score
from areal_plugins.rewards.service import RewardService

DELAY_S = 0.2


def slow_verifier(data_source, solution, truth, extra):
    """math-verify after a fixed wait (the extra info carries the delay)."""
    time.sleep((extra or {}).get("delay_s", DELAY_S))
    return compute_score(data_source, solution, truth, extra)


def throughput(workers: int, calls: int, delay_s: float) -> float:
    service = RewardService(slow_verifier, num_workers=workers, timeout_s=30.0, retries=0)
    try:
        service.score("d", "warm up", "1", {"delay_s": 0.0})  # the workers' imports are not timed
        started = time.perf_counter()
        with ThreadPoolExecutor(max(workers, 8)) as pool:
            list(pool.map(lambda i: service.score("d", f"{i % 9}", "3", {"delay_s": delay_s}), range(calls)))
        return calls / (time.perf_counter() - started)
    finally:
        service.close()


async def overlap_trial(overlap: bool, lengths: list[int], service: RewardService, seed: int) -> float:
    from areal_plugins.rollout.cpu.engine import ContinuousBatchingEngine
    from areal_plugins.tiny.model import TinyModelSpec, random_qwen2

    model = random_qwen2(TinyModelSpec(seed=seed), vocab_size=16448).eval()
    engine = ContinuousBatchingEngine(model, eos_token_ids=[], max_batch_size=len(lengths), seed=seed)
    prompts = [[1 + (i * 7 + j) % 500 for j in range(16)] for i in range(len(lengths))]
    pool = ThreadPoolExecutor(16)
    loop = asyncio.get_running_loop()

    def score() -> float:
        return service.score("d", "3", "3", {"delay_s": DELAY_S})

    started = time.perf_counter()

    async def one(prompt: list[int], n: int):
        await engine.generate(prompt, max_tokens=n)
        return loop.run_in_executor(pool, score) if overlap else None

    pending = await asyncio.gather(*(one(p, n) for p, n in zip(prompts, lengths, strict=True)))
    if overlap:
        await asyncio.gather(*pending)
    else:
        await asyncio.gather(*(loop.run_in_executor(pool, score) for _ in lengths))
    pool.shutdown()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--calls", type=int, default=64)
    parser.add_argument("--delay-s", type=float, default=DELAY_S)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("runs/bench_reward.json"))
    args = parser.parse_args()
    report: dict = {"machine": f"{platform.machine()}, torch threads default", "settings": vars(args)}
    rows = {}
    for workers in args.workers:
        runs = [throughput(workers, args.calls, args.delay_s) for _ in range(args.repeats)]
        rows[workers] = {"calls_per_s_median": statistics.median(runs), "min": min(runs), "max": max(runs)}
        print(
            f"{workers} workers: {rows[workers]['calls_per_s_median']:.1f} rewards/s ({min(runs):.1f}-{max(runs):.1f})"
        )
    report["throughput"] = rows
    service = RewardService(slow_verifier, num_workers=4, timeout_s=30.0, retries=0)
    service.score("d", "warm up", "1", {"delay_s": 0.0})
    overlap_rows: dict[str, list[float]] = {"after_generation": [], "as_each_finishes": []}
    try:
        for repeat in range(args.repeats):
            rng = random.Random(repeat)
            lengths = [max(1, min(128, int(rng.lognormvariate(0, 1.0) * 24))) for _ in range(args.calls)]
            for name, overlap in (("after_generation", False), ("as_each_finishes", True)):
                wall = asyncio.run(overlap_trial(overlap, lengths, service, repeat))
                overlap_rows[name].append(wall)
                print(f"repeat {repeat + 1}: rewards {name}: {wall:.2f} s until the last reward")
    finally:
        service.close()
    report["overlap_4_workers"] = {
        name: {"wall_s_median": statistics.median(v), "min": min(v), "max": max(v), "runs": v}
        for name, v in overlap_rows.items()
    }
    after = report["overlap_4_workers"]["after_generation"]["wall_s_median"]
    during = report["overlap_4_workers"]["as_each_finishes"]["wall_s_median"]
    report["overlap_speedup"] = after / during
    print(f"overlap: {after:.2f} s -> {during:.2f} s (x{after / during:.2f})")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2, default=str))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
