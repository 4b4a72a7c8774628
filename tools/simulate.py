"""The CPU box's model of synchronous vs asynchronous (AReaL) RL training: ``python tools/simulate.py``.

For GPU clusters use ``areal-plugins plan`` and ``tools/simulate_paper.py`` (areal_plugins/planning: a
memory-bound decode model held against the paper; docs/simulator.md). This one models the 2-core box
the bench runs on, where per-trajectory Python work, not decoding, is most of generation time.

What it models (one run = ``steps`` PPO steps of ``batch`` prompt groups x ``group`` responses):

- **Generation**: every rollout device decodes up to ``slots`` sequences at once, each at ``decode_tps``
  tokens/s (decode is memory-bound: per-sequence speed does not depend on the batch), after a serial
  per-trajectory ``overhead_s`` on that device (tokenise, reward, bookkeeping: on the CPU box this
  Python work, not decoding, is most of generation time).
  Response lengths come from a log-normal with median ``length_median`` and shape ``length_sigma``
  (the long tail), capped at ``length_max``.
- **Training**: ``train_tps`` trained tokens/s per device, plus ``train_fixed_s`` per step.
- **Sync** (verl's default): all ``devices`` generate the whole batch, wait for the longest response,
  then all train. **Async separate** (AReaL): ``rollout_devices`` generate all the time under the
  staleness bound capacity(v) = (η + v + 1)·B - (accepted + running); the other devices train as soon
  as B groups are buffered; weight updates interrupt in-flight requests (cost ``interrupt_s``).

Calibrated on this repository's CPU runs: per-trajectory overhead and training speed measured with verl
on 2 cores. ``--calibrate-from BENCH_JSON`` fits it to a bench's sync runs and predicts its async rows,
with a second limit the event model lacks: both sides share the machine's cores (``shared_cores_s_per_1k``).
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import random
import re
import statistics
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path


@dataclass(frozen=True)
class Workload:
    steps: int = 20
    batch: int = 16  # prompt groups per step
    group: int = 8  # responses per prompt
    length_median: float = 3.0
    length_sigma: float = 0.4
    length_max: int = 16
    prompt_len: int = 17


@dataclass(frozen=True)
class Hardware:
    devices: int = 2
    rollout_devices: int = 1  # async separate: the rest train
    slots: int = 128  # concurrent sequences per rollout device
    decode_tps: float = 150.0  # tokens/s of one sequence
    overhead_s: float = 0.094  # serial per-trajectory work on a rollout device
    train_tps: float = 284.0  # trained tokens/s per training device
    train_fixed_s: float = 0.6
    interrupt_s: float = 0.15
    # Training speed grows as devices**train_scaling (1.0: linear; the 2-core box: ~0.5, one core trains
    # only 1.35x slower than two).
    train_scaling: float = 1.0
    # True: one serial queue for the per-trajectory overhead whatever the device count (verl's single
    # agent-loop worker process on the CPU box); False: one queue per rollout device.
    overhead_shared: bool = False
    # The share of sync's training work per token the async trainer does (``prox_logp: loglinear`` skips
    # the old-log-prob forward pass that sync makes every step).
    async_train_work: float = 1.0


CALIBRATIONS = {
    # verl on the 2-core box, tiny model, two cores as two "devices": sync gen ~6 s for 128 trajectories
    # of ~2.5 tokens (verl's per-trajectory Python work, 2 x 6 / 128 s each), train (old log-prob +
    # update) ~5 s for ~2,500 tokens. On the real box the two sides share both cores rather than one
    # each: ``compare_with_bench`` adds that limit.
    "cpu": (
        Workload(),
        Hardware(overhead_s=0.047, train_tps=403.0, train_scaling=0.5, overhead_shared=True),
    ),
}


def sample_lengths(workload: Workload, count: int, rng: random.Random) -> list[int]:
    mu = math.log(workload.length_median)
    return [
        max(1, min(workload.length_max, round(rng.lognormvariate(mu, workload.length_sigma)))) for _ in range(count)
    ]


class RolloutPool:
    """``devices`` x ``slots`` decode slots, each device with a serial per-trajectory overhead queue."""

    def __init__(self, hw: Hardware, devices: int) -> None:
        self.hw = hw
        self.devices = devices
        self.slots = [[0.0] * hw.slots for _ in range(devices)]
        self.overhead_free = [0.0] * (1 if hw.overhead_shared else devices)
        self.next_device = 0

    def submit(self, length: int, now: float) -> float:
        """Return when a trajectory of ``length`` tokens submitted at ``now`` is finished."""
        device = self.next_device
        self.next_device = (device + 1) % self.devices
        queue = 0 if self.hw.overhead_shared else device
        ready = max(now, self.overhead_free[queue]) + self.hw.overhead_s
        self.overhead_free[queue] = ready
        slots = self.slots[device]
        start = max(heapq.heappop(slots), ready)
        end = start + length / self.hw.decode_tps
        heapq.heappush(slots, end)
        return end


def generation_time(lengths: list[int], hw: Hardware, devices: int) -> float:
    """Finish time of a batch submitted at once, longest first."""
    pool = RolloutPool(hw, devices)
    return max(pool.submit(length, 0.0) for length in sorted(lengths, reverse=True))


def train_time(tokens: int, hw: Hardware, devices: int) -> float:
    return hw.train_fixed_s + tokens / (hw.train_tps * devices**hw.train_scaling)


def simulate_sync(workload: Workload, hw: Hardware, seed: int = 0) -> dict:
    rng = random.Random(seed)
    clock = 0.0
    tokens = 0
    gen_total = train_total = 0.0
    ends, step_tokens_list = [], []
    for _ in range(workload.steps):
        lengths = sample_lengths(workload, workload.batch * workload.group, rng)
        gen = generation_time(lengths, hw, hw.devices)
        step_tokens = sum(lengths) + workload.prompt_len * len(lengths)
        train = train_time(step_tokens, hw, hw.devices)
        clock += gen + train
        gen_total += gen
        train_total += train
        tokens += step_tokens
        ends.append(clock)
        step_tokens_list.append(step_tokens)
    return {
        "wall_s": clock,
        "tokens": tokens,
        "gen_s": gen_total,
        "train_s": train_total,
        "step_ends": ends,
        "step_tokens": step_tokens_list,
    }


def simulate_async(workload: Workload, hw: Hardware, eta: int, seed: int = 0) -> dict:
    """Event simulation of the staleness-bounded pipeline on disjoint rollout and training devices."""
    rng = random.Random(seed)
    train_devices = max(1, hw.devices - hw.rollout_devices)
    pool = RolloutPool(hw, hw.rollout_devices)
    finished: list[tuple[float, int, int]] = []  # (finish time, tokens, submit version) per group
    accepted_submitted = 0
    version = 0
    trainer_free = 0.0
    tokens = 0
    staleness = []
    clock = 0.0
    step_ends, step_tokens_list = [], []
    decoding: list[tuple[float, float]] = []  # (start, end) of each trajectory's decoding
    for _ in range(workload.steps):
        # Admission: submit every group the bound allows at this version (time = when it was allowed).
        limit = (eta + version + 1) * workload.batch
        while accepted_submitted < limit:
            lengths = sample_lengths(workload, workload.group, rng)
            ends = [pool.submit(length, clock) for length in lengths]
            decoding += [(end - length / hw.decode_tps, end) for end, length in zip(ends, lengths, strict=True)]
            group_tokens = sum(lengths) + workload.prompt_len * len(lengths)
            finished.append((max(ends), group_tokens, version))
            accepted_submitted += 1
        # The trainer takes the B oldest groups once they are done.
        batch = finished[: workload.batch]
        del finished[: workload.batch]
        ready = max(end for end, _, _ in batch)
        start = max(ready, trainer_free)
        step_tokens = sum(t for _, t, _ in batch)
        trainer_free = start + hw.async_train_work * train_time(step_tokens, hw, train_devices) + hw.interrupt_s
        staleness += [version - v for _, _, v in batch]
        tokens += step_tokens
        version += 1
        clock = trainer_free  # the next admissions happen at this version, from now
        step_ends.append(trainer_free)
        step_tokens_list.append(step_tokens)
    done = [(start, end) for start, end in decoding if end <= trainer_free]
    interrupted = sum(any(start < update < end for update in step_ends) for start, end in done)
    return {
        "wall_s": trainer_free,
        "tokens": tokens,
        "staleness_mean": sum(staleness) / len(staleness),
        "interrupted_fraction": interrupted / max(1, len(done)),
        "step_ends": step_ends,
        "step_tokens": step_tokens_list,
    }


def s_per_1k_tokens_after_first(run: dict) -> float:
    """Seconds per 1k trained tokens over steps 2..N, as the bench counts them (step 1 pays start-up)."""
    return 1000 * (run["step_ends"][-1] - run["step_ends"][0]) / sum(run["step_tokens"][1:])


def speedup(workload: Workload, hw: Hardware, eta: int, seeds: int = 3) -> float:
    ratios = []
    for seed in range(seeds):
        sync = simulate_sync(workload, hw, seed)
        run = simulate_async(workload, hw, eta, seed)
        ratios.append((sync["wall_s"] / sync["tokens"]) / (run["wall_s"] / run["tokens"]))
    return sorted(ratios)[len(ratios) // 2]


def best_split(workload: Workload, hw: Hardware, eta: int, seeds: int = 1) -> tuple[Hardware, float]:
    """The rollout/training device split that maximises the async speedup (the paper tunes it too)."""
    if hw.devices <= 2:
        return hw, speedup(workload, hw, eta, seeds)
    counts = sorted({max(1, min(hw.devices - 1, round(hw.devices * f / 8))) for f in range(1, 8)})
    options = [(speedup(workload, replace(hw, rollout_devices=r), eta, seeds), r) for r in counts]
    best, rollout = max(options)
    return replace(hw, rollout_devices=rollout), best


def trends(workload: Workload, hw: Hardware, seeds: int) -> dict:
    out: dict = {"eta": {}, "tail_sigma": {}, "devices": {}}
    for eta in (0, 1, 2, 4, 8):
        out["eta"][eta] = speedup(workload, hw, eta, seeds)
    for sigma in (0.1, 0.3, 0.6, 0.9):
        out["tail_sigma"][sigma] = speedup(replace(workload, length_sigma=sigma), hw, 4, seeds)
    base = simulate_sync(workload, hw)
    for scale in (1, 2, 4, 8):
        scaled = replace(hw, devices=hw.devices * scale, rollout_devices=max(1, hw.rollout_devices * scale))
        big = replace(workload, batch=workload.batch * scale)
        run = simulate_async(big, scaled, 4)
        out["devices"][scale] = {
            "async_tokens_per_s": run["tokens"] / run["wall_s"],
            "throughput_vs_1x_sync": (run["tokens"] / run["wall_s"]) / (base["tokens"] / base["wall_s"]),
        }
    return out


def lognormal_from_mean_and_max(mean: float, expected_max: float, count: int) -> tuple[float, float]:
    """(median, sigma) of the log-normal whose mean is ``mean`` and whose largest of ``count`` draws is
    about ``expected_max``: mean = m·e^(σ²/2) and max ≈ m·e^(σ·z) at z = Φ⁻¹(1 - 1/(count+1)), so
    ln(max/mean) = σz - σ²/2; the smaller root is the one below z."""
    z = statistics.NormalDist().inv_cdf(1 - 1 / (count + 1))
    gap = math.log(max(expected_max, mean) / mean)
    sigma = z - math.sqrt(max(z * z - 2 * gap, 0.0))
    return mean / math.exp(sigma * sigma / 2), sigma


def fit_rate(target_s: float, time_at: Callable[[float], float], low: float = 1e-3, high: float = 1e6) -> float:
    """The rate r with time_at(r) = target_s, for time_at decreasing in r (geometric bisection)."""
    for _ in range(100):
        middle = math.sqrt(low * high)
        low, high = (middle, high) if time_at(middle) > target_s else (low, middle)
    return math.sqrt(low * high)


def calibrate_from_bench(bench: dict, base: Hardware = CALIBRATIONS["cpu"][1]) -> tuple[Workload, Hardware]:
    """Fit the model to a bench.json's synchronous runs: the length distribution from the measured mean
    and longest response per step, decode speed so the simulated sync generation takes the measured
    time, training speed so sync training does. Overhead per trajectory and the training scaling with
    cores stay those of the ``cpu`` calibration (one sync run cannot separate them)."""
    sync = next(row for row in bench["rows"] if row["config"] == "sync")
    count = round(sync["trajectories_per_step"]["median"])
    mean, longest = sync["response_len_mean"]["median"], sync["response_len_max"]["median"]
    median, sigma = lognormal_from_mean_and_max(mean, longest, count)
    group = Workload().group  # verl's rollout.n in every recipe (bench.json does not record it)
    workload = Workload(
        steps=bench["steps_per_run"],
        batch=count // group,
        group=group,
        length_median=median,
        length_sigma=sigma,
        length_max=int(max(run["response_len_max"] for run in bench["runs"]["sync"])),
        prompt_len=round(sync["prompt_len_mean"]["median"]),
    )
    lengths = sample_lengths(workload, count, random.Random(0))
    gen_s, train_s = sync["gen_s_median"]["median"], sync["train_s_median"]["median"]
    overhead = min(base.overhead_s, 0.9 * gen_s / count)  # leave room for decoding
    hw = replace(base, overhead_s=overhead)
    decode = fit_rate(gen_s, lambda rate: generation_time(lengths, replace(hw, decode_tps=rate), hw.devices))
    tokens = sum(lengths) + workload.prompt_len * count
    train_tps = tokens / (max(train_s - hw.train_fixed_s, 0.1) * hw.devices**hw.train_scaling)
    return workload, replace(hw, decode_tps=decode, train_tps=train_tps)


def eta_of(config: str) -> int | None:
    match = re.fullmatch(r"async-separate-eta(\d+)(-recompute|-loglinear)?", config)
    return int(match.group(1)) if match else None


def skips_old_log_prob(bench: dict, config: str) -> bool:
    """Whether the bench ran ``config`` with ``prox_logp: loglinear`` (its first mode has no name suffix)."""
    modes = bench.get("prox_logp", "loglinear")
    first = modes[0] if isinstance(modes, list) else modes
    return config.endswith("-loglinear") or (first == "loglinear" and not config.endswith("-recompute"))


def machine_cores(bench: dict) -> int:
    match = re.search(r"(\d+) CPUs", bench.get("machine", ""))
    if not match:
        raise SystemExit("the bench JSON does not say how many CPUs its machine had ('machine': '... N CPUs ...')")
    return int(match.group(1))


def shared_cores_s_per_1k(
    sync_cpu_s_per_1k: float, work: float, interrupted: float, extra_cpu_s: float, tokens_per_trajectory: float,
    cores: int,
) -> float:  # fmt: skip
    """The fastest async can go when both sides share the machine's cores: its CPU work per 1k tokens over
    the cores. The work is sync's measured CPU time per token, less the passes async skips (``work`` < 1),
    plus one more per-trajectory overhead for each interrupted trajectory (its second request re-prefills)."""
    cpu = sync_cpu_s_per_1k * work + interrupted * extra_cpu_s * 1000 / tokens_per_trajectory
    return cpu / cores


def compare_with_bench(bench: dict, seeds: int = 5) -> dict:
    """The calibrated model's sync and async (separate placement) costs next to the measured ones.

    Two limits, the slower wins: the pipeline on disjoint devices (the event simulation) and the shared
    cores (``shared_cores_s_per_1k``): on the 2-core box the second one decides every row with overlap."""
    workload, hw = calibrate_from_bench(bench)
    rows = {row["config"]: row for row in bench["rows"]}
    cores = machine_cores(bench)
    sync_row = rows["sync"]
    tokens_per_trajectory = sync_row["prompt_len_mean"]["median"] + sync_row["response_len_mean"]["median"]
    extra_cpu_s = hw.overhead_s * sync_row["busy_cores"]["median"]
    sync_model = statistics.median(
        s_per_1k_tokens_after_first(simulate_sync(workload, hw, seed)) for seed in range(seeds)
    )
    out = {
        "workload": asdict(workload),
        "hardware": asdict(hw),
        "sync": {"measured_s_per_1k": rows["sync"]["s_per_1k_tokens"]["median"], "model_s_per_1k": sync_model},
        "async": [],
    }
    for name, row in rows.items():
        eta = eta_of(name)
        if eta is None:
            continue
        work = 1.0
        if skips_old_log_prob(bench, name) and "old_log_prob_s_median" in rows["sync"]:
            work = 1 - rows["sync"]["old_log_prob_s_median"]["median"] / rows["sync"]["train_s_median"]["median"]
        runs = [simulate_async(workload, replace(hw, async_train_work=work), eta, seed) for seed in range(seeds)]
        pipeline = statistics.median(s_per_1k_tokens_after_first(run) for run in runs)
        interrupted = statistics.median(run["interrupted_fraction"] for run in runs)
        # The skipped old-log-prob pass is its share of sync's step (the cores are about as busy in each phase).
        cpu_work = 1.0
        if work < 1.0:
            cpu_work = 1 - rows["sync"]["old_log_prob_s_median"]["median"] / rows["sync"]["step_s_median"]["median"]
        shared = shared_cores_s_per_1k(
            sync_row["cpu_s_per_1k_tokens"]["median"], cpu_work, interrupted, extra_cpu_s, tokens_per_trajectory, cores
        )
        model = max(pipeline, shared)
        measured = row["s_per_1k_tokens"]
        one_core_train = work * train_time(round(statistics.mean(runs[0]["step_tokens"])), hw, 1)
        out["async"].append({
            "config": name,
            "measured_s_per_1k": measured["median"],
            "measured_range": [measured["min"], measured["max"]],
            "model_s_per_1k": model,
            "model_pipeline_s_per_1k": pipeline,
            "model_shared_cores_s_per_1k": shared,
            "model_interrupted_fraction": interrupted,
            "within_spread": measured["min"] <= model <= measured["max"],
            "measured_speedup": row["speedup"]["median"],
            "model_speedup": sync_model / model,
            "measured_step_s": row["step_s_median"]["median"],
            "model_train_s_one_core": one_core_train,
        })  # fmt: skip
    return out


def print_comparison(result: dict) -> None:
    w, h = result["workload"], result["hardware"]
    print(
        f"fitted: lengths log-normal median {w['length_median']:.1f} sigma {w['length_sigma']:.2f} (cap "
        f"{w['length_max']}), decode {h['decode_tps']:.1f} tok/s per sequence, overhead {h['overhead_s']:.3f} s"
        f" per trajectory, training {h['train_tps']:.0f} tok/s per core"
    )
    sync = result["sync"]
    print(f"sync:  measured {sync['measured_s_per_1k']:.2f} s/1k tokens, model {sync['model_s_per_1k']:.2f}")
    for row in result["async"]:
        low, high = row["measured_range"]
        print(
            f"{row['config']}: measured {row['measured_s_per_1k']:.2f} s/1k tokens ({low:.2f}-{high:.2f}; "
            f"{row['measured_speedup']:.2f}x), model {row['model_s_per_1k']:.2f} ({row['model_speedup']:.2f}x: "
            f"pipeline {row['model_pipeline_s_per_1k']:.2f}, shared cores {row['model_shared_cores_s_per_1k']:.2f}, "
            f"{row['model_interrupted_fraction']:.0%} interrupted) "
            + ("within the measured spread" if row["within_spread"] else "OUTSIDE the measured spread")
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calibration", choices=sorted(CALIBRATIONS), default="cpu")
    parser.add_argument("--eta", type=int, default=4)
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.add_argument(
        "--calibrate-from",
        type=Path,
        metavar="BENCH_JSON",
        help="fit the model to a bench.json's sync runs and print its predictions next to the measured async runs",
    )
    args = parser.parse_args(argv)
    if args.calibrate_from:
        comparison = compare_with_bench(json.loads(args.calibrate_from.read_text()))
        print(json.dumps(comparison, indent=2)) if args.json else print_comparison(comparison)
        return 0
    workload, hw = CALIBRATIONS[args.calibration]
    seeds = 3
    hw, _ = best_split(workload, hw, args.eta, seeds)
    sync = simulate_sync(workload, hw)
    run = simulate_async(workload, hw, args.eta)
    result = {
        "calibration": args.calibration,
        "workload": asdict(workload),
        "hardware": asdict(hw),
        "sync": sync,
        "async": run,
        "speedup": (sync["wall_s"] / sync["tokens"]) / (run["wall_s"] / run["tokens"]),
        "sync_overlap_bound": (sync["gen_s"] + sync["train_s"]) / max(sync["gen_s"], sync["train_s"]),
        "trends": trends(workload, hw, seeds),
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"devices: {hw.devices}, of which {hw.rollout_devices} generate in async mode (best split)")
    print(
        f"{args.calibration}: sync {sync['wall_s']:.1f} s, async eta={args.eta} {run['wall_s']:.1f} s "
        f"-> speedup {result['speedup']:.2f}x (sync phase overlap bound {result['sync_overlap_bound']:.2f}x), "
        f"mean staleness {run['staleness_mean']:.2f}"
    )
    print("speedup by eta:        " + "  ".join(f"{k}: {v:.2f}x" for k, v in result["trends"]["eta"].items()))
    print(
        "speedup by length tail: "
        + "  ".join(f"sigma {k}: {v:.2f}x" for k, v in result["trends"]["tail_sigma"].items())
    )
    print(
        "async scaling:          "
        + "  ".join(f"{k}x devices: {v['throughput_vs_1x_sync']:.2f}x" for k, v in result["trends"]["devices"].items())
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
