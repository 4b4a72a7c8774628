"""The AReaL paper's 1.5B setup, the fit of the cluster simulator's two free parameters to its two end-to-end step
times, and the prediction of its Table 1: for ``tools/simulate_paper.py`` and the GPU-shaped stand-in
(:mod:`areal_bench.gpu_shaped`), not the package (``areal-plugins plan`` uses the fitted result,
``areal_plugins.planning.plan.PAPER_FIT``).

Everything else the paper reports (its η sweep, its scaling figure, the gain from interruptible
generation, the 7B, 14B and 32B rows of its Table 1) is held out: ``tools/simulate_paper.py`` predicts it
and puts it beside the paper's numbers. Sources in docs/simulator.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from areal_plugins.planning.calibration import STEPS, WARMUP, paper_sync_generating_gpus
from areal_plugins.planning.cluster_sim import Cluster, Workload, simulate_async, simulate_sync
from areal_plugins.planning.hardware import GPUS, MODELS, Efficiency

#: 16 nodes of 8 H800; 96 GPUs generate, 32 train (AReaL's documented 16-node allocation).
PAPER_GPUS = 128
PAPER_ROLLOUT_GPUS = 96
#: 512 prompts x 16 responses per step, responses capped at 27,648 tokens (AReaL's 1.5B, 16-node config).
#: 19.0M trained tokens per step = 128.7k tokens/s (Fig. 5c, η = 0) x 147.6 s (41.0 h / 1000 steps):
#: 2,317 tokens per sequence, of which ~200 prompt.
PAPER_WORKLOAD = Workload(batch=512, group=16, response_mean=2117.0, truncated_fraction=0.005, prompt=200)
PAPER_SYNC_STEP_S = 41.0 * 3600 / 1000  # Table 1 (the v0.3 blog: 1000 PPO steps), synchronous AReaL, 1.5B
PAPER_ASYNC_STEP_S = 14.8 * 3600 / 1000  # Table 1, asynchronous AReaL (η = 4: its AIME24 42.2 is Table 3's η = 4)
PAPER_ETA = 4
#: Fig. 5c effective training throughput (k tokens/s) by η; inf = unbounded.
PAPER_THROUGHPUT_BY_ETA = {0: 128.7, 1: 269.3, 2: 356.6, 4: 356.6, 8: 371.7, 16: 382.4, math.inf: 396.8}
#: The paper's strong scaling (1.5B, tokens/s): ~29k on 32 GPUs to ~235k on 256.
PAPER_SCALING = {32: 29e3, 256: 235e3}
#: Interruptible generation: +12% generation throughput (1.5B, 4 nodes = 32 GPUs).
PAPER_INTERRUPT_GAIN_1_5B = 0.12


@dataclass(frozen=True)
class TableRow:
    """One model of the paper's Table 1: synchronous and asynchronous AReaL on the same H800 nodes and steps."""

    nodes: int
    sync_hours: float
    async_hours: float
    steps: int | None = None  # PPO steps, where the step time can be compared with the 1.5B workload's

    @property
    def gpus(self) -> int:
        return 8 * self.nodes

    @property
    def speedup(self) -> float:
        return self.sync_hours / self.async_hours


#: Table 1 (and, for 1.5B and 7B, the AReaL v0.3 blog's Table 2: 1000 steps each). 1.5B and 7B are math
#: (AIME24), 14B and 32B code (LiveCodeBench): a workload the paper does not describe, so only their
#: speedups, not their step times, are compared. The 1.5B row is the fit; the other three are held out,
#: each run on the 1.5B workload (the paper gives no throughput or length distribution for them).
PAPER_TABLE1 = {
    "1.5b": TableRow(16, 41.0, 14.8, steps=1000),
    "7b": TableRow(24, 57.7, 25.4, steps=1000),
    "14b": TableRow(32, 48.8, 21.9),
    "32b": TableRow(48, 51.1, 31.1),
}


@dataclass(frozen=True)
class Fit:
    efficiency: Efficiency
    sync_step_s: float
    async_step_s: float
    iterations: int


def paper_cluster(efficiency: Efficiency, gpus: int = PAPER_GPUS, rollout_gpus: int = PAPER_ROLLOUT_GPUS) -> Cluster:
    return Cluster(GPUS["h800"], MODELS["1.5b"], efficiency, gpus, rollout_gpus)


def sync_step_s(cluster: Cluster, work: Workload, seeds: int = 1) -> float:
    """A step of the paper's synchronous AReaL (not verl's colocated one: ``plan`` compares with that)."""
    per_seed = []
    generating = paper_sync_generating_gpus(cluster)
    for seed in range(seeds):
        run = simulate_sync(cluster, work, steps=3, seed=seed, generating_gpus=generating)
        per_seed.append(run.step_s(warmup=0))
    return sum(per_seed) / seeds


def async_step_s(cluster: Cluster, work: Workload, eta: float, seeds: int = 1, **kwargs) -> float:
    per_seed = []
    for seed in range(seeds):
        per_seed.append(simulate_async(cluster, work, eta, steps=STEPS, seed=seed, **kwargs).step_s(WARMUP))
    return sum(per_seed) / seeds


#: Weights and KV cache stream at the datasheet's HBM bandwidth: whatever else a decode step costs is the
#: fitted per-layer latency, not a discount on every byte.
DECODE_BANDWIDTH = 1.0
FIT_START = Efficiency(DECODE_BANDWIDTH, 0.3, 50e-6)


def fit_efficiency(work: Workload = PAPER_WORKLOAD, start: Efficiency = FIT_START, rounds: int = 12) -> Fit:
    """The per-layer decode step latency and the compute efficiency that reproduce the paper's sync and
    async step times (the HBM bandwidth stays at ``start``'s share).

    The sync step is mostly decoding (the longest response, one step per token), the async step mostly
    training (32 GPUs train what 96 generate), so each ratio corrects mainly its own parameter: the sync
    ratio rescales a lone sequence's step (latency + weights), of which only the latency is free.
    """
    efficiency = start
    sync = asynchronous = math.nan
    model = MODELS["1.5b"]
    for round_ in range(1, rounds + 1):
        cluster = paper_cluster(efficiency)
        sync = sync_step_s(cluster, work)
        asynchronous = async_step_s(cluster, work, PAPER_ETA)
        if abs(sync / PAPER_SYNC_STEP_S - 1) < 0.005 and abs(asynchronous / PAPER_ASYNC_STEP_S - 1) < 0.005:
            return Fit(efficiency, sync, asynchronous, round_)
        engine = cluster.engine()
        weights = model.weight_bytes / engine.bandwidth
        lone_step = weights + engine.step_latency
        efficiency = replace(
            efficiency,
            decode_step_latency=max(0.0, lone_step * PAPER_SYNC_STEP_S / sync - weights) / model.layers,
            compute=min(1.0, efficiency.compute * asynchronous / PAPER_ASYNC_STEP_S),
        )
    return Fit(efficiency, sync, asynchronous, rounds)


@dataclass(frozen=True)
class TablePrediction:
    sync_step_s: float
    async_step_s: float

    @property
    def speedup(self) -> float:
        """As the paper measures it: the same number of steps, synchronous hours over asynchronous hours."""
        return self.sync_step_s / self.async_step_s


def predict_table1(model: str, efficiency: Efficiency, work: Workload = PAPER_WORKLOAD, seeds: int = 1):
    """A Table 1 row on the paper's cluster: all GPUs synchronous vs 3/4 generating at η = 4, 1/4 training."""
    row = PAPER_TABLE1[model]
    cluster = Cluster(GPUS["h800"], MODELS[model], efficiency, row.gpus, row.gpus * 3 // 4)
    return TablePrediction(sync_step_s(cluster, work, seeds), async_step_s(cluster, work, PAPER_ETA, seeds))
