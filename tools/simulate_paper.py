"""The cluster simulator held against the AReaL paper: ``python tools/simulate_paper.py``.

Fits the two efficiencies (decode bandwidth, training compute) to the paper's two end-to-end step times
(Table 2, 1.5B on 128 H800), then predicts what was held out — Fig. 5c's throughput by η, the strong
scaling from 32 to 256 GPUs, the gain from interruptible generation — over several seeds, and repeats
the η sweep with other response-length tails to show how much the one unsourced shape choice matters.
Writes docs/results/simulator_vs_paper.json and .png; docs/simulator.md reads them.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

from areal_plugins.planning.calibration import (
    PAPER_7B,
    PAPER_ASYNC_STEP_S,
    PAPER_ETA,
    PAPER_GPUS,
    PAPER_INTERRUPT_GAIN_1_5B,
    PAPER_ROLLOUT_GPUS,
    PAPER_SCALING,
    PAPER_SYNC_STEP_S,
    PAPER_THROUGHPUT_BY_ETA,
    PAPER_WORKLOAD,
    STEPS,
    WARMUP,
    async_step_s,
    fit_efficiency,
    paper_cluster,
    sync_step_s,
)
from areal_plugins.planning.cluster_sim import Cluster, Workload, simulate_async, simulate_sync
from areal_plugins.planning.hardware import GPUS, MODELS, Efficiency

RESULTS = Path(__file__).resolve().parents[1] / "docs" / "results"


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def eta_key(eta: float) -> str:
    return "inf" if math.isinf(eta) else str(int(eta))


def sync_tokens_per_s(efficiency: Efficiency, work: Workload, seed: int) -> float:
    return simulate_sync(paper_cluster(efficiency), work, steps=4, seed=seed).tokens_per_s(warmup=0)


def eta_sweep(efficiency: Efficiency, work: Workload, seeds: int) -> dict:
    out = {}
    for eta in PAPER_THROUGHPUT_BY_ETA:
        values = [
            simulate_async(paper_cluster(efficiency), work, eta, STEPS, seed=seed).tokens_per_s(WARMUP)
            for seed in range(seeds)
        ]
        out[eta_key(eta)] = spread(values)
        print(f"  eta {eta_key(eta)}: {out[eta_key(eta)]['median'] / 1e3:.1f}k tokens/s", flush=True)
    return out


def scaling(efficiency: Efficiency, work: Workload, seeds: int) -> dict:
    out = {}
    for gpus in (32, 64, 128, 256):
        cluster = paper_cluster(efficiency, gpus, gpus * PAPER_ROLLOUT_GPUS // PAPER_GPUS)
        values = [
            simulate_async(cluster, work, PAPER_ETA, STEPS, seed=seed).tokens_per_s(WARMUP) for seed in range(seeds)
        ]
        out[str(gpus)] = spread(values)
        print(f"  {gpus} GPUs: {out[str(gpus)]['median'] / 1e3:.1f}k tokens/s", flush=True)
    return out


def interruption(efficiency: Efficiency, work: Workload, seeds: int) -> dict:
    """Generation throughput (decoded tokens/s) with and without interruption, 32 GPUs, by split."""
    out = {}
    for rollout in (24, 16, 8):
        cluster = paper_cluster(efficiency, 32, rollout)
        gains = []
        for seed in range(seeds):
            on, off = (
                simulate_async(cluster, work, PAPER_ETA, STEPS, seed=seed, interruptible=flag) for flag in (True, False)
            )
            gains.append((on.decoded_tokens / on.step_ends[-1]) / (off.decoded_tokens / off.step_ends[-1]) - 1)
        out[f"{rollout}+{32 - rollout}"] = spread(gains)
        print(f"  {rollout} generating + {32 - rollout} training: {statistics.median(gains):+.1%}", flush=True)
    return out


def run(seeds: int) -> dict:
    started = time.time()
    print("fitting the efficiencies to the paper's two step times ...", flush=True)
    fit = fit_efficiency()
    efficiency = fit.efficiency
    print(f"  {efficiency} after {fit.iterations} rounds", flush=True)
    sync = spread([sync_tokens_per_s(efficiency, PAPER_WORKLOAD, seed) for seed in range(seeds)])
    print("eta sweep (Fig. 5c) ...", flush=True)
    sweep = eta_sweep(efficiency, PAPER_WORKLOAD, seeds)
    print("strong scaling ...", flush=True)
    scale = scaling(efficiency, PAPER_WORKLOAD, seeds)
    print("interruptible generation ...", flush=True)
    interrupt = interruption(efficiency, PAPER_WORKLOAD, seeds)
    print("the 7B run (held out) ...", flush=True)
    seven = Cluster(GPUS["h800"], MODELS["7b"], efficiency, PAPER_7B["gpus"], PAPER_7B["gpus"] * 3 // 4)
    seven_b = {
        "model_s": {
            "sync_step": sync_step_s(seven, PAPER_WORKLOAD),
            "async_step": async_step_s(seven, PAPER_WORKLOAD, PAPER_ETA),
        },
        "paper_s": {"sync_step": PAPER_7B["sync_step_s"], "async_step": PAPER_7B["async_step_s"]},
    }
    print(f"  {seven_b}", flush=True)
    print("sensitivity to the length tail (refitted each time) ...", flush=True)
    tails = {}
    for fraction in (0.001, 0.01):
        work = replace(PAPER_WORKLOAD, truncated_fraction=fraction)
        refit = fit_efficiency(work)
        tails[str(fraction)] = {
            "efficiency": asdict(refit.efficiency),
            "eta": {
                eta_key(eta): simulate_async(paper_cluster(refit.efficiency), work, eta, STEPS).tokens_per_s(WARMUP)
                for eta in (0, 1, 2, 8)
            },
        }
    return {
        "what": "cluster simulator (areal_plugins/planning) vs the AReaL paper, 1.5B on H800; docs/simulator.md",
        "seconds": round(time.time() - started, 1),
        "seeds": seeds,
        "steps": STEPS,
        "warmup_steps": WARMUP,
        "workload": asdict(PAPER_WORKLOAD),
        "lognormal_mu_sigma": PAPER_WORKLOAD.lognormal(),
        "fit": {
            "efficiency": asdict(efficiency),
            "targets_s": {"sync_step": PAPER_SYNC_STEP_S, "async_step": PAPER_ASYNC_STEP_S},
            "model_s": {"sync_step": fit.sync_step_s, "async_step": fit.async_step_s},
        },
        "sync_tokens_per_s": sync,
        "eta_tokens_per_s": sweep,
        "paper_eta_ktokens_per_s": {eta_key(k): v for k, v in PAPER_THROUGHPUT_BY_ETA.items()},
        "scaling_tokens_per_s": scale,
        "paper_scaling_tokens_per_s": {str(k): v for k, v in PAPER_SCALING.items()},
        "interrupt_gain": interrupt,
        "paper_interrupt_gain": PAPER_INTERRUPT_GAIN_1_5B,
        "tail_sensitivity": tails,
        "held_out_7b": seven_b,
    }


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, middle, right) = plt.subplots(1, 3, figsize=(15, 4.2))
    keys = list(result["paper_eta_ktokens_per_s"])
    x = range(len(keys))
    ours = [result["eta_tokens_per_s"][k]["median"] / 1e3 for k in keys]
    low = [result["eta_tokens_per_s"][k]["min"] / 1e3 for k in keys]
    high = [result["eta_tokens_per_s"][k]["max"] / 1e3 for k in keys]
    left.plot(x, list(result["paper_eta_ktokens_per_s"].values()), "o-", color="black", label="paper (Fig. 5c)")
    left.plot(x, ours, "s-", color="tab:blue", label="simulator (seed range shaded)")
    left.fill_between(x, low, high, color="tab:blue", alpha=0.2)
    sync = result["sync_tokens_per_s"]["median"] / 1e3
    left.axhline(sync, color="tab:gray", ls=":", label=f"simulated synchronous ({sync:.0f}k)")
    left.set_xticks(list(x), ["∞" if k == "inf" else k for k in keys])
    left.set_xlabel("η (max staleness)")
    left.set_ylabel("k trained tokens/s")
    left.set_ylim(bottom=0)
    left.set_title("1.5B, 128 H800 (96 generate)")
    left.legend(fontsize=8)
    gpus = [int(k) for k in result["scaling_tokens_per_s"]]
    middle.plot(gpus, [result["scaling_tokens_per_s"][str(g)]["median"] / 1e3 for g in gpus], "s-", label="simulator")
    paper_gpus = [int(k) for k in result["paper_scaling_tokens_per_s"]]
    middle.plot(paper_gpus, [v / 1e3 for v in result["paper_scaling_tokens_per_s"].values()], "o", color="black",
                label="paper (its own workload)")  # fmt: skip
    middle.set_xscale("log", base=2)
    middle.set_yscale("log", base=2)
    middle.set_xlabel("GPUs (3/4 generate)")
    middle.set_ylabel("k trained tokens/s")
    middle.set_title("strong scaling, η = 4")
    middle.legend(fontsize=8)
    splits = list(result["interrupt_gain"])
    right.bar(splits, [100 * result["interrupt_gain"][s]["median"] for s in splits], color="tab:blue")
    right.axhline(100 * result["paper_interrupt_gain"], color="black", ls="--", label="paper: +12% (split not given)")
    right.set_xlabel("GPUs generating + training (32)")
    right.set_ylabel("generation throughput gain, %")
    right.set_title("interruptible generation, η = 4")
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=RESULTS / "simulator_vs_paper.json")
    args = parser.parse_args(argv)
    result = run(args.seeds)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    plot(result, args.out.with_suffix(".png"))
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
