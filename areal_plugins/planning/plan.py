"""``areal-plugins plan``: size an asynchronous run before renting the GPUs.

Plans both placements on the cluster simulator: ``colocated`` (every GPU generates, then trains: what
``+areal.enable=true`` alone gives), over η; and ``separate`` (a pool of engines beside the trainer), searching the
rollout:trainer split at the paper's η = 4, then η at that split. Each placement's η is the smallest within 5% of
its best throughput (staleness costs accuracy: the paper's Table 3); the placement is colocated unless separate is
more than 5% faster (one flag, no pools to size). Then one verdict: that placement and η, or synchronous verl where
neither is predicted :data:`MIN_SPEEDUP` times faster, with the speedup's range when both fitted parameters (the
decode step latency, the compute efficiency) are 30% off, and the recipe keys to set.

Without a sample of the user's answer lengths the plan draws the paper's (:data:`PAPER_WORKLOAD`), cut at the
recipe's cap (``--max-response``: ``data.max_response_length``), and says so: a mean is never above the cap.

``--split`` and ``--eta`` fix what it would search; ``--baseline areal-sync`` compares with the paper's
synchronous AReaL (half the GPUs generate, then the other half train) instead of verl's colocated trainer, which
is how the paper's Table 1 speedups are measured.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from statistics import NormalDist

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
#: The paper's answer lengths (arXiv 2505.24298; docs/simulator.md, "tokens per sequence"): a log-normal of mean
#: 2,117 tokens with 0.5% past its 27,648-token cap. The plan's lengths when the user gives none.
PAPER_WORKLOAD = Workload(response_mean=2117.0, truncated_fraction=0.005, max_response=27648)
#: The placements ``plan`` compares; ``colocated`` first: what ``+areal.enable=true`` alone gives.
PLACEMENTS = ("colocated", "separate")


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
    #: the placement the numbers above are of (the faster one; colocated unless separate is 5% faster)
    placement: str = "separate"
    #: every placement planned: name -> (its η, its trained tokens/s at that η)
    placements: dict[str, tuple[int, float]] = field(default_factory=dict)
    #: trained tokens/s by η of each placement (empty where it was not planned); separate's at its best split
    colocated_by_eta: dict[int, float] = field(default_factory=dict)
    separate_by_eta: dict[int, float] = field(default_factory=dict)

    @property
    def speedup(self) -> float:
        return self.async_tokens_per_s / self.sync_tokens_per_s

    @property
    def verdict(self) -> str:
        """The one answer: ``colocated`` or ``separate`` at :attr:`eta`, or ``synchronous`` where the better placement
        is predicted less than :data:`MIN_SPEEDUP` times the baseline's throughput."""
        return self.placement if self.speedup >= MIN_SPEEDUP else "synchronous"


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


def capped_mean(mu: float, sigma: float, cap: float) -> float:
    """E[min(X, cap)] for X log-normal(μ, σ): e^(μ+σ²/2)·Φ((ln cap − μ − σ²)/σ) + cap·(1 − Φ((ln cap − μ)/σ)),
    the mean answer when every answer longer than the cap is cut there."""
    unit = NormalDist()
    z = (math.log(cap) - mu) / sigma
    return math.exp(mu + sigma * sigma / 2) * unit.cdf(z - sigma) + cap * (1 - unit.cdf(z))


def default_workload(batch: int, group: int, max_response: int, prompt: int) -> tuple[Workload, str]:
    """The paper's answer lengths (:data:`PAPER_WORKLOAD`) cut at ``max_response``, and the line saying so
    (``warning:`` where the cap is below the paper's, so that more answers are cut than the paper's were)."""
    mu, sigma = PAPER_WORKLOAD.lognormal()
    paper = PAPER_WORKLOAD
    if max_response == paper.max_response:
        work = replace(paper, batch=batch, group=group, prompt=prompt)
        return work, (
            f"responses: the paper's lengths (mean {paper.response_mean:,.0f} tokens, {paper.truncated_fraction:.1%} "
            f"past {paper.max_response:,}); give --lengths-file or --response-mean for your task's"
        )
    truncated = 1 - NormalDist(mu, sigma).cdf(math.log(max_response))
    mean = capped_mean(mu, sigma, max_response)
    work = Workload(batch=batch, group=group, response_mean=mean, truncated_fraction=truncated,
                    max_response=max_response, prompt=prompt, log_mu=mu, log_sigma=sigma)  # fmt: skip
    line = (
        f"responses: the paper's lengths (mean {paper.response_mean:,.0f} tokens, {paper.truncated_fraction:.1%} past "
        f"{paper.max_response:,}) cut at this cap of {max_response:,} (--max-response, the recipe's "
        f"data.max_response_length): mean {mean:,.0f}, {truncated:.1%} of answers reach the cap; give --lengths-file "
        "or --response-mean for your task's"
    )
    return work, f"warning: {line}" if max_response < paper.max_response else line


def tokens_per_s(cluster: Cluster, work: Workload, eta: float, seed: int = 0, colocated: bool = False) -> float:
    return simulate_async(cluster, work, eta, STEPS, seed=seed, colocated=colocated).tokens_per_s(WARMUP)


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
    """``split``: the GPUs that generate (None: searched; given, only ``separate`` is planned); ``baseline``: one
    of :data:`BASELINES`."""
    etas = tuple(etas)
    tp = smallest_tensor_parallel(cluster.gpu, cluster.model)
    colocated_by_eta: dict[int, float] = {}
    if split is None:
        for eta in etas:
            colocated_by_eta[eta] = tokens_per_s(cluster, work, eta, colocated=True)
            progress(f"colocated, η = {eta}: {colocated_by_eta[eta]:,.0f} tokens/s")
    separate = _plan_separate(cluster, work, progress, etas, split, tp, required=split is not None)
    rollout, by_split, by_eta = separate if separate else (cluster.gpus, {}, {})
    # each placement planned: (its η, its tokens/s at that η)
    placements = {
        name: (choose_eta(by), by[choose_eta(by)])
        for name, by in (("colocated", colocated_by_eta), ("separate", by_eta))
        if by
    }
    colocated_tokens = placements.get("colocated", (0, 0.0))[1]
    placement = (
        "separate"
        if "separate" in placements and placements["separate"][1] > (1 + ETA_TOLERANCE) * colocated_tokens
        else "colocated"
    )
    eta, chosen_tokens_per_s = placements[placement]
    colocated = placement == "colocated"
    best_cluster = cluster if colocated else replace(cluster, rollout_gpus=rollout)
    baseline_tokens_per_s, baseline_name = BASELINES[baseline]
    sync = baseline_tokens_per_s(cluster, work)
    progress(f"{baseline_name}, {cluster.gpus} GPUs: {sync:,.0f} tokens/s")
    speedups = [chosen_tokens_per_s / sync]
    for latency in (1 - EFFICIENCY_DOUBT, 1 + EFFICIENCY_DOUBT):
        for compute in (1 - EFFICIENCY_DOUBT, 1 + EFFICIENCY_DOUBT):
            efficiency = replace(
                cluster.efficiency,
                decode_step_latency=cluster.efficiency.decode_step_latency * latency,
                compute=min(1.0, cluster.efficiency.compute * compute),
            )
            varied = replace(best_cluster, efficiency=efficiency)
            speedups.append(tokens_per_s(varied, work, eta, colocated=colocated) / baseline_tokens_per_s(varied, work))
    progress(f"uncertainty ({placement}): decode step latency and compute efficiency ±30%")
    return Plan(
        eta=eta,
        rollout_gpus=cluster.gpus if colocated else rollout,
        train_gpus=cluster.gpus if colocated else cluster.gpus - rollout,
        tensor_parallel=tp,
        async_tokens_per_s=chosen_tokens_per_s,
        sync_tokens_per_s=sync,
        speedup_range=(min(speedups), max(speedups)),
        throughput_by_eta=colocated_by_eta if colocated else by_eta,
        throughput_by_split=by_split,
        baseline=baseline_name,
        placement=placement,
        placements=placements,
        colocated_by_eta=colocated_by_eta,
        separate_by_eta=by_eta,
    )


def _plan_separate(
    cluster: Cluster,
    work: Workload,
    progress: Callable[[str], None],
    etas: tuple[int, ...],
    split: int | None,
    tp: int,
    required: bool,
) -> tuple[int, dict[int, float], dict[int, float]] | None:
    """The separate placement: the best split at η = 4, then η at that split; (generating GPUs, tokens/s by split,
    tokens/s by η), or None where the cluster holds no engine beside a trainer and ``required`` is false."""
    try:
        splits = candidate_splits(cluster.gpus, tp)
    except SystemExit as refusal:
        if required:
            raise
        progress(f"separate: not planned ({refusal})")
        return None
    if split is not None:
        if split not in splits:
            raise SystemExit(
                f"--split {split}: the generating GPUs must be a multiple of the engine's {tp} GPUs and leave at "
                f"least one to train; choose one of {', '.join(map(str, splits))}"
            )
        splits = [split]
    by_split = {}
    for rollout in splits:
        by_split[rollout] = tokens_per_s(replace(cluster, rollout_gpus=rollout), work, eta=4)
        progress(
            f"separate, {rollout} generate + {cluster.gpus - rollout} train, η = 4: {by_split[rollout]:,.0f} tokens/s"
        )
    rollout = max(by_split, key=by_split.__getitem__)
    by_eta = {}
    for eta in etas:
        by_eta[eta] = by_split[rollout] if eta == 4 else tokens_per_s(replace(cluster, rollout_gpus=rollout), work, eta)
        progress(f"separate, η = {eta}: {by_eta[eta]:,.0f} tokens/s")
    return rollout, by_split, by_eta


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
    """The recipe keys of the plan's verdict (YAML paths; :func:`command_line` writes them as overrides)."""
    if plan.verdict == "synchronous":
        return ["# asynchrony is not predicted to pay here: keep verl's synchronous trainer (areal.enable: false)"]
    train_nodes, train_per_node = pool_shape(plan.train_gpus, gpus_per_node)
    keys = ["areal.enable: true", f"areal.max_staleness: {plan.eta}", f"areal.placement: {plan.verdict}"]
    keys += [f"trainer.nnodes: {train_nodes}", f"trainer.n_gpus_per_node: {train_per_node}"]
    if plan.verdict == "separate":
        rollout_nodes, rollout_per_node = pool_shape(plan.rollout_gpus, gpus_per_node)
        keys += [
            f"actor_rollout_ref.rollout.nnodes: {rollout_nodes}",
            f"actor_rollout_ref.rollout.n_gpus_per_node: {rollout_per_node}",
        ]
    backend = "nccl" if plan.verdict == "separate" else "naive"  # colocated engines take the weights in-process
    return [
        *keys,
        f"actor_rollout_ref.rollout.tensor_model_parallel_size: {plan.tensor_parallel}",
        f"actor_rollout_ref.rollout.checkpoint_engine.backend: {backend}",
        f"data.train_batch_size: {work.batch}",
        f"actor_rollout_ref.rollout.n: {work.group}",
        f"data.max_response_length: {work.max_response}",
    ]


def command_line(keys: list[str]) -> str:
    """The keys as overrides on verl's own ``ppo_trainer.yaml``, which has no ``areal`` node: every ``areal`` key
    takes a leading + (docs/guides/own_recipe.md); a recipe with ``areal: default`` in its defaults takes them
    without."""
    pairs = [key.split(": ", 1) for key in keys if not key.startswith("#")]
    return " ".join(f"{'+' if path.startswith('areal.') else ''}{path}={value}" for path, value in pairs)


def _throughputs(by_eta: dict[int, float]) -> str:
    return "  ".join(f"[η={e}: {v / 1e3:,.1f}k]" for e, v in by_eta.items())


def _verdict_line(plan: Plan) -> str:
    low, high = plan.speedup_range
    numbers = (
        f"{plan.async_tokens_per_s / 1e3:,.1f}k trained tokens/s vs {plan.baseline} "
        f"{plan.sync_tokens_per_s / 1e3:,.1f}k: {plan.speedup:.2f}x (range {low:.2f}-{high:.2f}x if the fitted "
        f"decode latency and compute efficiency are ±{EFFICIENCY_DOUBT:.0%} off)"
    )
    if plan.verdict == "synchronous":
        return (
            f"  verdict: stay synchronous (areal.enable: false): the faster placement, {plan.placement} at η = "
            f"{plan.eta}, is predicted {numbers}, under the {MIN_SPEEDUP}x asynchrony needs to pay for its staleness"
        )
    return f"  verdict: {plan.verdict}, η = {plan.eta}: {numbers}"


def format_plan(plan: Plan, cluster: Cluster, work: Workload, gpus_per_node: int, notes: Iterable[str] = ()) -> str:
    """The answer: the workload, each placement's throughputs, one verdict, its recipe keys."""
    lines = [
        f"{cluster.gpus} x {cluster.gpu.name}, {cluster.model.name}, {work.batch} prompts x {work.group}, "
        f"responses mean {work.response_mean:,.0f} tokens (max {work.max_response:,})",
        *(f"  {note}" for note in notes),
    ]
    if plan.colocated_by_eta:
        eta, value = plan.placements["colocated"]
        lines.append(
            f"  colocated (every GPU generates, then trains; what +areal.enable=true alone gives): "
            f"{_throughputs(plan.colocated_by_eta)}  best η {eta}: {value / 1e3:,.1f}k tok/s"
        )
    if "separate" in plan.placements:
        eta, value = plan.placements["separate"]
        split = max(plan.throughput_by_split, key=plan.throughput_by_split.__getitem__)
        lines.append(
            "  separate (engines in a pool of their own): at η = 4 by generating GPUs  "
            + "  ".join(f"[{r}: {v / 1e3:,.1f}k]" for r, v in plan.throughput_by_split.items())
            + f"; {split} generate + {cluster.gpus - split} train: {_throughputs(plan.separate_by_eta)}  "
            f"best η {eta}: {value / 1e3:,.1f}k tok/s"
        )
    lines.append(_verdict_line(plan))
    keys = recipe_keys(plan, work, gpus_per_node)
    if plan.verdict != "synchronous":
        engines = f"{plan.rollout_gpus // plan.tensor_parallel} engine(s) of {plan.tensor_parallel} GPU(s)"
        lines.append(f"  recommended η (areal.max_staleness): {plan.eta}; placement: {plan.verdict}, {engines}")
    lines += ["  recipe keys:", *(f"    {key}" for key in keys)]
    if plan.verdict != "synchronous":
        lines.append(f"  on verl's own ppo_trainer.yaml: {command_line(keys)}")
    if "separate" in plan.placements:
        lines.append(
            "  split: the fewest GPUs generation needs, not more: nothing fitted measures a full engine's speed, and "
            "the paper's own η curve puts it ~1.9x below the model's (its authors ran 3:1 where this model picks 1:1)"
        )
    lines.append(
        "  model: docs/simulator.md (fitted to the paper's 1.5B step times; its error on the paper's other models and "
        "what it does not capture are listed there)"
    )
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
    work, notes = plan_workload(args)
    notes = [*getattr(args, "notes", []), *notes]
    if model.vision is not None:
        notes.append(
            f"model: a vision-language model: its {model.vision_params / 1e9:.2f}B-parameter vision tower counts in "
            "the engines' and trainer's weights; encoding images is not simulated (the prompt's image tokens are, as "
            "--prompt-len)"
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
    print(format_plan(plan, cluster, work, args.gpus_per_node, notes))
    return 0


def plan_workload(args) -> tuple[Workload, list[str]]:
    """The answer lengths the plan draws, and lines saying where they come from: a sample (``--lengths-file``, cut
    at the cap), a mean (``--response-mean``, refused above the cap), or the paper's cut at the cap."""
    cap = args.max_response
    if args.lengths_file:
        lengths = read_lengths(args.lengths_file)
        over = sum(n > cap for n in lengths)
        work = workload_from_lengths([min(n, cap) for n in lengths], args.batch, args.group, cap, args.prompt_len)
        note = f"warning: {over} of {len(lengths)} lengths are above --max-response {cap:,}: cut there" if over else ""
        return work, [f"responses: {len(lengths)} lengths from {args.lengths_file}", *([note] if note else [])]
    if args.response_mean is None:
        work, line = default_workload(args.batch, args.group, cap, args.prompt_len)
        return work, [line]
    if args.response_mean > cap:
        raise SystemExit(
            f"--response-mean {args.response_mean:g} is above the answers' cap --max-response {cap} (the recipe's "
            "data.max_response_length): no answer is longer than the cap; give a mean below it"
        )
    work = Workload(batch=args.batch, group=args.group, response_mean=args.response_mean,
                    truncated_fraction=args.truncated_fraction, max_response=cap, prompt=args.prompt_len)  # fmt: skip
    return work, [f"responses: mean {args.response_mean:,.0f} (--response-mean), {args.truncated_fraction:.1%} past it"]
