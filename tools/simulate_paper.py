"""The cluster simulator held against the AReaL paper: ``python tools/simulate_paper.py``.

Fits the two free parameters (the decode step's per-layer latency, the training compute efficiency) to the
paper's two end-to-end step times (1.5B on 128 H800), then predicts what was held out — Table 1's 7B, 14B
and 32B speedups, Fig. 5c's throughput by η, the strong scaling from 32 to 256 GPUs, the gain from
interruptible generation — over several seeds, and repeats the η sweep with other response-length tails
to show how much the one unsourced shape choice matters.
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

from areal_bench.paper import (
    PAPER_ASYNC_STEP_S,
    PAPER_ETA,
    PAPER_GPUS,
    PAPER_INTERRUPT_GAIN_1_5B,
    PAPER_ROLLOUT_GPUS,
    PAPER_SCALING,
    PAPER_SYNC_STEP_S,
    PAPER_TABLE1,
    PAPER_THROUGHPUT_BY_ETA,
    PAPER_WORKLOAD,
    fit_efficiency,
    paper_cluster,
    predict_table1,
)
from repeats import spread

from areal_plugins.planning.calibration import STEPS, WARMUP, paper_sync_generating_gpus
from areal_plugins.planning.cluster_sim import Workload, simulate_async, simulate_sync
from areal_plugins.planning.hardware import Efficiency

RESULTS = Path(__file__).resolve().parents[1] / "docs" / "results"


def eta_key(eta: float) -> str:
    return "inf" if math.isinf(eta) else str(int(eta))


def sync_tokens_per_s(efficiency: Efficiency, work: Workload, seed: int) -> float:
    """The paper's synchronous AReaL: half the GPUs generate, then the other half train."""
    cluster = paper_cluster(efficiency)
    run = simulate_sync(cluster, work, steps=4, seed=seed, generating_gpus=paper_sync_generating_gpus(cluster))
    return run.tokens_per_s(warmup=0)


def table1(efficiency: Efficiency, work: Workload, seeds: int) -> dict:
    """Each model of Table 1 at its cluster (3/4 generating, η = 4) against synchronous AReaL."""
    out = {}
    for model, row in PAPER_TABLE1.items():
        prediction = predict_table1(model, efficiency, work, seeds=seeds)
        entry = {
            "gpus": row.gpus,
            "held_out": model != "1.5b",
            "model_s": {"sync_step": prediction.sync_step_s, "async_step": prediction.async_step_s},
            "speedup": prediction.speedup,
            "paper_speedup": row.speedup,
            "error": prediction.speedup / row.speedup - 1,
        }
        if row.steps:
            entry["paper_s"] = {
                "sync_step": row.sync_hours * 3600 / row.steps,
                "async_step": row.async_hours * 3600 / row.steps,
            }
        out[model] = entry
        print(f"  {model}: {prediction.speedup:.2f}x vs the paper's {row.speedup:.2f}x ({entry['error']:+.1%})",
              flush=True)  # fmt: skip
    return out


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


#: Splits (GPUs generating) held against the paper's choice, 3/4 generating: the 1.5B on its 128 GPUs and the 7B on
#: its 192 (Table 1), η = 4; speedups over synchronous AReaL on the same GPUs, as Table 1 measures them.
SPLITS = {"1.5b": (128, (64, 80, 96, 112)), "7b": (192, (96, 120, 144, 168))}


def splits(efficiency: Efficiency, work: Workload, seeds: int) -> dict:
    """Throughput and speedup by rollout:trainer split, η = 4, against the paper's 3:1 (its Table 1 runs)."""
    from areal_bench.paper import sync_step_s

    from areal_plugins.planning.cluster_sim import Cluster
    from areal_plugins.planning.hardware import GPUS, MODELS

    out = {}
    for model, (gpus, rollouts) in SPLITS.items():
        sync = sync_step_s(Cluster(GPUS["h800"], MODELS[model], efficiency, gpus), work, seeds)
        row: dict = {"gpus": gpus, "paper_split": gpus * 3 // 4, "paper_speedup": PAPER_TABLE1[model].speedup}
        for rollout in rollouts:
            cluster = Cluster(GPUS["h800"], MODELS[model], efficiency, gpus, rollout)
            runs = [simulate_async(cluster, work, PAPER_ETA, STEPS, seed=seed) for seed in range(seeds)]
            step = statistics.median(run.step_s(WARMUP) for run in runs)
            row[str(rollout)] = {
                "tokens_per_s": spread([run.tokens_per_s(WARMUP) for run in runs]),
                "step_s": step,
                "speedup": sync / step,
            }
        row["best_split"] = int(max(rollouts, key=lambda r: row[str(r)]["tokens_per_s"]["median"]))
        out[model] = row
        print(f"  {model}: " + ", ".join(f"{r}: {row[str(r)]['speedup']:.2f}x" for r in rollouts)
              + f" (best {row['best_split']}; the paper ran {row['paper_split']})", flush=True)  # fmt: skip
    return out


#: One node, as issue 51 quotes the paper's Table 7 (8 GPUs): throughput at η = 2 is 1.76x that at η = 0. Only that
#: ratio is quoted; the table's split and workload are not, so the sweep runs the Table 1 workload at each split.
EIGHT_GPU_SPLITS = (4, 6)
PAPER_8GPU_ETA2_OVER_ETA0 = 1.76


def eta_sweep_8gpu(efficiency: Efficiency, work: Workload, seeds: int) -> dict:
    out = {}
    for rollout in EIGHT_GPU_SPLITS:
        cluster = paper_cluster(efficiency, 8, rollout)
        by_eta = {
            eta_key(eta): statistics.median(
                simulate_async(cluster, work, eta, STEPS, seed=seed).tokens_per_s(WARMUP) for seed in range(seeds)
            )
            for eta in (0, 1, 2, 4, 8)
        }
        out[f"{rollout}+{8 - rollout}"] = {"tokens_per_s": by_eta, "eta2_over_eta0": by_eta["2"] / by_eta["0"]}
        print(f"  8 GPUs, {rollout} generating: η = 2 is {by_eta['2'] / by_eta['0']:.2f}x η = 0", flush=True)
    return out


def run(seeds: int) -> dict:
    started = time.time()
    print("fitting the decode step latency and compute efficiency to the paper's two step times ...", flush=True)
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
    print("Table 1: 1.5B (fitted), 7B, 14B, 32B (held out) ...", flush=True)
    models = table1(efficiency, PAPER_WORKLOAD, seeds)
    print("rollout:trainer splits (1.5B, 7B) ...", flush=True)
    by_split = splits(efficiency, PAPER_WORKLOAD, seeds)
    print("η sweep on one node (8 GPUs) ...", flush=True)
    eight = eta_sweep_8gpu(efficiency, PAPER_WORKLOAD, seeds)
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
        "table1": models,
        "splits": by_split,
        "eta_8gpu": eight,
        "paper_8gpu_eta2_over_eta0": PAPER_8GPU_ETA2_OVER_ETA0,
    }


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, middle, right, models) = plt.subplots(1, 4, figsize=(20, 4.2))
    keys = list(result["paper_eta_ktokens_per_s"])
    x = range(len(keys))
    ours = [result["eta_tokens_per_s"][k]["median"] / 1e3 for k in keys]
    low = [result["eta_tokens_per_s"][k]["min"] / 1e3 for k in keys]
    high = [result["eta_tokens_per_s"][k]["max"] / 1e3 for k in keys]
    left.plot(x, list(result["paper_eta_ktokens_per_s"].values()), "o-", color="black", label="paper (Fig. 5c)")
    left.plot(x, ours, "s-", color="tab:blue", label="simulator (seed range shaded)")
    left.fill_between(x, low, high, color="tab:blue", alpha=0.2)
    sync = result["sync_tokens_per_s"]["median"] / 1e3
    left.axhline(sync, color="tab:gray", ls=":", label=f"simulated synchronous AReaL ({sync:.0f}k)")
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
    names = list(result["table1"])
    x = range(len(names))
    models.bar([i - 0.2 for i in x], [result["table1"][n]["paper_speedup"] for n in names], 0.4, color="black",
               label="paper (Table 1)")  # fmt: skip
    models.bar([i + 0.2 for i in x], [result["table1"][n]["speedup"] for n in names], 0.4, color="tab:blue",
               label="simulator (1.5B fitted, others held out)")  # fmt: skip
    for i, n in enumerate(names):
        models.annotate(f"{result['table1'][n]['error']:+.0%}", (i + 0.2, result["table1"][n]["speedup"]),
                        ha="center", va="bottom", fontsize=8)  # fmt: skip
    models.set_xticks(list(x), [n.upper() for n in names])
    models.set_ylabel("async (η = 4) over synchronous AReaL")
    models.set_title("Table 1: 16 / 24 / 32 / 48 nodes, 3/4 generating")
    models.legend(fontsize=8)
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
