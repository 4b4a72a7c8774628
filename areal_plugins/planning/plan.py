"""``areal-plugins plan``: size an asynchronous run before renting the GPUs.

Searches the rollout:trainer split at the paper's η = 4, then η at that split, on the cluster
simulator; recommends the smallest η within 5% of the best throughput (staleness costs accuracy: the
paper's Table 3), and prints the expected speedup over synchronous verl with its range when both fitted
parameters (the decode step latency, the compute efficiency) are 30% off, and the recipe keys to set.

``--split`` and ``--eta`` fix what it would search; ``--baseline areal-sync`` compares with the paper's
synchronous AReaL (half the GPUs generate, then the other half train) instead of verl's colocated trainer, which
is how the paper's Table 1 speedups are measured.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path

from areal_plugins.planning.calibration import STEPS, WARMUP  # the fit's run length: the plan's numbers are the fit's
from areal_plugins.planning.cluster_sim import Cluster, Workload, simulate_async, simulate_sync
from areal_plugins.planning.hardware import GPUS, Efficiency, smallest_tensor_parallel
from areal_plugins.planning.model_shapes import UnknownModelError, resolve_for_plan

#: Fitted to the paper's 1.5B step times (tools/simulate_paper.py; docs/results/simulator_vs_paper.json): a
#: decode step costs 82 µs per layer beyond its bytes (read at the datasheet bandwidth) and FLOPs.
PAPER_FIT = Efficiency(decode_bandwidth=1.0, compute=0.179, decode_step_latency=82e-6)
ETAS = (0, 1, 2, 4, 8)
SPLIT_SHARES = (0.25, 0.375, 0.5, 0.625, 0.75, 0.875)
#: An η whose throughput is within this share of the best is good enough: smaller η, fresher samples.
ETA_TOLERANCE = 0.05
#: How far the fitted parameters may be off on another cluster and software stack (the range printed).
EFFICIENCY_DOUBT = 0.3
#: Below this predicted speedup asynchrony is not worth its staleness: stay synchronous.
MIN_SPEEDUP = 1.1


BASELINE_DEFAULT_NAME = "synchronous verl (all GPUs generate, then all train)"


@dataclass(frozen=True)
class Plan:
    eta: int
    rollout_gpus: int
    train_gpus: int
    tensor_parallel: int
    async_tokens_per_s: float
    sync_tokens_per_s: float
    speedup_range: tuple[float, float]
    throughput_by_eta: dict[int, float]
    throughput_by_split: dict[int, float]
    baseline: str = BASELINE_DEFAULT_NAME

    @property
    def speedup(self) -> float:
        return self.async_tokens_per_s / self.sync_tokens_per_s


def read_lengths(path: Path) -> list[int]:
    """Response lengths in tokens, one number per line (blank lines and ``#`` comments skipped)."""
    lengths = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        text = line.split("#", 1)[0].strip()
        if not text:
            continue
        try:
            value = int(float(text))
        except ValueError:
            raise SystemExit(f"{path}:{number}: {text!r} is not a response length; write one number per line") from None
        if value < 1:
            raise SystemExit(f"{path}:{number}: a response length must be at least 1 token, not {value}")
        lengths.append(value)
    if len(lengths) < 20:
        raise SystemExit(f"{path} holds {len(lengths)} lengths; give at least 20 to estimate the tail")
    return lengths


def workload_from_lengths(lengths: list[int], batch: int, group: int, max_response: int, prompt: int) -> Workload:
    """The log-normal of the sample's log-lengths (maximum likelihood), capped at ``max_response``."""
    logs = [math.log(n) for n in lengths]
    mu, sigma = statistics.fmean(logs), statistics.pstdev(logs)
    return Workload(
        batch=batch,
        group=group,
        response_mean=statistics.fmean(lengths),
        max_response=max_response,
        prompt=prompt,
        log_mu=mu,
        log_sigma=sigma,
    )


def tokens_per_s(cluster: Cluster, work: Workload, eta: float, seed: int = 0) -> float:
    return simulate_async(cluster, work, eta, STEPS, seed=seed).tokens_per_s(WARMUP)


def sync_tokens_per_s(cluster: Cluster, work: Workload, seed: int = 0) -> float:
    """verl's synchronous trainer: every GPU generates, then every GPU trains."""
    return simulate_sync(cluster, work, steps=3, seed=seed).tokens_per_s(warmup=0)


def areal_sync_tokens_per_s(cluster: Cluster, work: Workload, seed: int = 0) -> float:
    """The paper's synchronous AReaL: half the GPUs generate, then the other half train."""
    from areal_plugins.planning.calibration import paper_sync_generating_gpus

    generating = paper_sync_generating_gpus(cluster)
    return simulate_sync(cluster, work, steps=3, seed=seed, generating_gpus=generating).tokens_per_s(warmup=0)


#: What the speedup is measured against: name -> (throughput, how the plan says it).
BASELINES: dict[str, tuple[Callable[[Cluster, Workload], float], str]] = {
    "verl": (sync_tokens_per_s, BASELINE_DEFAULT_NAME),
    "areal-sync": (areal_sync_tokens_per_s, "the paper's synchronous AReaL (half generate, then half train)"),
}


def candidate_splits(gpus: int, tensor_parallel: int) -> list[int]:
    """Rollout GPU counts to try: shares of the cluster, whole engines, at least one GPU left to train."""
    counts = set()
    for share in SPLIT_SHARES:
        rollout = round(gpus * share / tensor_parallel) * tensor_parallel
        if tensor_parallel <= rollout <= gpus - 1:
            counts.add(rollout)
    if not counts:
        raise SystemExit(
            f"{gpus} GPUs cannot hold one inference engine ({tensor_parallel} GPUs) and a trainer: "
            "plan for more GPUs, or run synchronously"
        )
    return sorted(counts)


def make_plan(
    cluster: Cluster,
    work: Workload,
    progress: Callable[[str], None] = lambda _: None,
    etas: Iterable[int] = ETAS,
    split: int | None = None,
    baseline: str = "verl",
) -> Plan:
    """``split``: the GPUs that generate (None: searched); ``baseline``: one of :data:`BASELINES`."""
    tp = smallest_tensor_parallel(cluster.gpu, cluster.model)
    splits = candidate_splits(cluster.gpus, tp)
    if split is not None:
        if split not in splits:
            raise SystemExit(
                f"--split {split}: the generating GPUs must be a multiple of the engine's {tp} GPUs and leave at "
                f"least one to train; choose one of {', '.join(map(str, splits))}"
            )
        splits = [split]
    baseline_tokens_per_s, baseline_name = BASELINES[baseline]
    by_split = {}
    for rollout in splits:
        by_split[rollout] = tokens_per_s(replace(cluster, rollout_gpus=rollout), work, eta=4)
        progress(f"{rollout} generating + {cluster.gpus - rollout} training, η = 4: {by_split[rollout]:,.0f} tokens/s")
    rollout = max(by_split, key=by_split.__getitem__)
    best_cluster = replace(cluster, rollout_gpus=rollout)
    by_eta = {}
    for eta in etas:
        by_eta[eta] = by_split[rollout] if eta == 4 else tokens_per_s(best_cluster, work, eta)
        progress(f"η = {eta}: {by_eta[eta]:,.0f} tokens/s")
    eta = choose_eta(by_eta)
    sync = baseline_tokens_per_s(cluster, work)
    progress(f"{baseline_name}, {cluster.gpus} GPUs: {sync:,.0f} tokens/s")
    speedups = []
    for latency in (1 - EFFICIENCY_DOUBT, 1 + EFFICIENCY_DOUBT):
        for compute in (1 - EFFICIENCY_DOUBT, 1 + EFFICIENCY_DOUBT):
            efficiency = replace(
                cluster.efficiency,
                decode_step_latency=cluster.efficiency.decode_step_latency * latency,
                compute=min(1.0, cluster.efficiency.compute * compute),
            )
            varied = replace(best_cluster, efficiency=efficiency)
            speedups.append(tokens_per_s(varied, work, eta) / baseline_tokens_per_s(varied, work))
    progress("uncertainty: decode step latency and compute efficiency ±30%")
    speedups.append(by_eta[eta] / sync)
    return Plan(
        eta=eta,
        rollout_gpus=rollout,
        train_gpus=cluster.gpus - rollout,
        tensor_parallel=tp,
        async_tokens_per_s=by_eta[eta],
        sync_tokens_per_s=sync,
        speedup_range=(min(speedups), max(speedups)),
        throughput_by_eta=by_eta,
        throughput_by_split=by_split,
        baseline=baseline_name,
    )


def choose_eta(throughput_by_eta: dict[int, float]) -> int:
    """The smallest η within ``ETA_TOLERANCE`` of the best throughput: fresher samples at nearly the speed."""
    best = max(throughput_by_eta.values())
    return min(eta for eta, value in throughput_by_eta.items() if value >= (1 - ETA_TOLERANCE) * best)


def pool_shape(gpus: int, per_node: int) -> tuple[int, int]:
    """(nnodes, n_gpus_per_node) for a pool of ``gpus``: whole nodes, or a part of one."""
    if gpus <= per_node:
        return 1, gpus
    if gpus % per_node:
        raise SystemExit(f"{gpus} GPUs do not fill whole {per_node}-GPU nodes; choose a split in whole nodes")
    return gpus // per_node, per_node


def recipe_keys(plan: Plan, work: Workload, gpus_per_node: int) -> list[str]:
    if plan.speedup < MIN_SPEEDUP:
        return ["# asynchrony is not predicted to pay here: keep verl's synchronous trainer (areal.enable: false)"]
    train_nodes, train_per_node = pool_shape(plan.train_gpus, gpus_per_node)
    rollout_nodes, rollout_per_node = pool_shape(plan.rollout_gpus, gpus_per_node)
    return [
        "areal.enable: true",
        f"areal.max_staleness: {plan.eta}",
        "areal.placement: separate",
        f"trainer.nnodes: {train_nodes}",
        f"trainer.n_gpus_per_node: {train_per_node}",
        f"actor_rollout_ref.rollout.nnodes: {rollout_nodes}",
        f"actor_rollout_ref.rollout.n_gpus_per_node: {rollout_per_node}",
        f"actor_rollout_ref.rollout.tensor_model_parallel_size: {plan.tensor_parallel}",
        "actor_rollout_ref.rollout.checkpoint_engine.backend: nccl",
        f"data.train_batch_size: {work.batch}",
        f"actor_rollout_ref.rollout.n: {work.group}",
        f"actor_rollout_ref.rollout.response_length: {work.max_response}",
    ]


def format_plan(plan: Plan, cluster: Cluster, work: Workload, gpus_per_node: int) -> str:
    low, high = plan.speedup_range
    lines = [
        f"{cluster.gpus} x {cluster.gpu.name}, {cluster.model.name}, {work.batch} prompts x {work.group}, "
        f"responses mean {work.response_mean:,.0f} tokens (max {work.max_response:,})",
        f"  recommended η (areal.max_staleness): {plan.eta}  "
        + "  ".join(f"[η={e}: {v / 1e3:,.1f}k tok/s]" for e, v in plan.throughput_by_eta.items()),
        f"  split: {plan.rollout_gpus} GPUs generate (engines of {plan.tensor_parallel}), {plan.train_gpus} train  "
        + "  ".join(f"[{r}: {v / 1e3:,.1f}k]" for r, v in plan.throughput_by_split.items()),
        "  placement: "
        + (
            "separate (disaggregated: the engines never wait for the trainer)"
            if plan.speedup >= MIN_SPEEDUP
            else "none: synchronous verl is as fast here"
        ),
        f"  expected: {plan.async_tokens_per_s / 1e3:,.1f}k trained tokens/s vs {plan.baseline} "
        f"{plan.sync_tokens_per_s / 1e3:,.1f}k: {plan.speedup:.2f}x (range {low:.2f}-{high:.2f}x if the "
        f"fitted decode latency and compute efficiency are ±{EFFICIENCY_DOUBT:.0%} off)",
        "  recipe keys:",
        *(f"    {key}" for key in recipe_keys(plan, work, gpus_per_node)),
        "  split: the fewest GPUs generation needs, not more: nothing fitted measures a full engine's speed, and the "
        "paper's own η curve puts it ~1.9x below the model's (its authors ran 3:1 where this model picks 1:1)",
        "  model: docs/simulator.md (fitted to the paper's 1.5B step times; its error on the paper's other models and "
        "what it does not capture are listed there)",
    ]
    return "\n".join(lines)


def resolve(name: str, table: dict, what: str):
    try:
        return table[name.lower()]
    except KeyError:
        raise SystemExit(f"unknown {what} {name!r}; choose one of {', '.join(sorted(table))}") from None


def run_plan(args) -> int:
    """The CLI entry (arguments from ``cli.add_plan_arguments``)."""
    gpu = resolve(args.gpu, GPUS, "GPU")
    try:
        model = resolve_for_plan(args.model, getattr(args, "model_config", None))
    except UnknownModelError as error:
        raise SystemExit(f"areal-plugins plan: {error}") from None
    if args.gpus < 2:
        raise SystemExit("--gpus must be at least 2: one side generates while the other trains")
    if args.lengths_file:
        work = workload_from_lengths(
            read_lengths(args.lengths_file), args.batch, args.group, args.max_response, args.prompt_len
        )
    else:
        work = Workload(
            batch=args.batch,
            group=args.group,
            response_mean=args.response_mean,
            truncated_fraction=args.truncated_fraction,
            max_response=args.max_response,
            prompt=args.prompt_len,
        )
    try:
        work.lognormal()
    except ValueError as error:
        raise SystemExit(str(error)) from None
    efficiency = Efficiency(args.decode_efficiency, args.compute_efficiency, PAPER_FIT.decode_step_latency)
    cluster = Cluster(gpu, model, efficiency, args.gpus)
    etas = ETAS if args.eta is None else (args.eta,)
    plan = make_plan(
        cluster,
        work,
        progress=lambda line: print(f"  ... {line}", flush=True),
        etas=etas,
        split=args.split,
        baseline=args.baseline,
    )
    print(format_plan(plan, cluster, work, args.gpus_per_node))
    return 0
