"""The planner held against the GPU-shaped bench: ``python tools/bench_vs_planner.py runs/bench-gpu/bench.json``.

The stand-in's engines *are* the planner's decode model (``tools/areal_bench/gpu_shaped.py``), so the planner's
simulator, given the same engines, batch and answer lengths and each row's **measured** trainer seconds per step,
should predict each row's speedup over synchronous verl. What it then tests is the rest of the model: the
pipeline (the staleness bound, interruption and the KV cache recomputed after it, colocated engines asleep while
the trainer computes) against the real control plane (verl's trainer, our driver, verl's agent loops, Ray).

Each row maps to a simulator mode:

- ``sync``: all engines generate, then the trainer trains (verl's colocated synchronous loop);
- ``async-separate-eta{η}[-engines{k}]``: AReaL's pipeline on ``k`` engines (default 1) beside the trainer;
- ``async-colocated-eta{η}``: the same pipeline with the engines asleep while the trainer computes;
- verl's ``colocate_async`` / ``separate_async``: the same two, at η = ``num_warmup_batches`` (verl keeps that
  many batches of prompts in flight ahead of the trainer, aborts and continues partial answers at each update).

The physical limit of the emulated system (a step costing only what its slower side needs, nothing waiting):
the synchronous trainer's seconds against the engines decoding one step's batch, refilled as each answer
finishes; separate: the larger of the two, colocated: their sum (they share the devices).

Writes ``planner.json`` beside the bench's file; ``tools/bench.py`` calls :func:`compare` after a gpu-shaped run.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from dataclasses import replace
from pathlib import Path

from areal_bench.token_staleness import DEFINITION as STALENESS_DEFINITION

#: Steps each simulation runs and leaves out at the start (the pipeline fills), and the seeds averaged.
STEPS, WARMUP, SEEDS = 40, 5, (0, 1, 2)
#: A prediction further than this from the measured speedup is an exception the results page must explain.
TOLERANCE = 0.15

#: ``-wait`` (``areal.weight_update.in_flight: wait``) runs as the same mode: the simulator interrupts at every update.
ROW = re.compile(r"^async-(?P<placement>separate|colocated)-eta(?P<eta>\d+)(?:-engines(?P<engines>\d+))?(?:-wait)?$")
WARMUP_KEY = re.compile(r"trainer\.v1\.(?:colocate|separate)_async\.num_warmup_batches=(?P<batches>[\d.]+)")


def row_mode(name: str, overrides: list[str]) -> tuple[str, float, int] | None:
    """(placement, η, engines) the simulator runs a bench row as; None: the synchronous row."""
    if name == "sync":
        return None
    if name.startswith("verl-"):
        batches = next((float(m["batches"]) for o in overrides if (m := WARMUP_KEY.search(o))), 1.0)
        placement = "colocated" if name.startswith("verl-colocate_async") else "separate"
        return placement, batches, 1
    match = ROW.match(name)
    if match is None:
        raise ValueError(f"bench row {name!r}: no simulator mode for it")
    return match["placement"], float(match["eta"]), int(match["engines"] or 1)


def _stand_in(bench: dict, engines: int, separate: bool):
    from areal_bench.gpu_shaped import StandInShape, case, stand_in_cluster

    scale = bench["time_scale"]
    prompts, answers = bench["batch"]["prompts"], bench["batch"]["answers"]
    shape = StandInShape(
        prompts, answers, round(bench["batch"]["prompt_tokens"]), bench["length_scale"], engines,
        bench.get("kv_capacity_tokens"),
    )  # fmt: skip
    cluster, work = stand_in_cluster(case(scale["case"], "--case"), shape)
    if not separate:  # every GPU generates (and trains): the engines alone
        return cluster, work
    tp = cluster.engine().tensor_parallel
    # One more device trains beside the engines; the train time is given, so its GPU does not matter.
    return replace(cluster, gpus=(engines + 1) * tp, rollout_gpus=engines * tp), work


def simulated_step_s(bench: dict, mode: tuple[str, float, int] | None, train_box_s: float) -> float:
    """The simulator's step for a row, in this box's seconds (mean over :data:`SEEDS`)."""
    from areal_plugins.planning.cluster_sim import simulate_async, simulate_sync

    time_scale = bench["time_scale"]["time_scale"]
    engines = 1 if mode is None else mode[2]
    cluster, work = _stand_in(bench, engines, separate=mode is not None and mode[0] == "separate")
    kwargs = {"train_time": lambda lengths: train_box_s / time_scale, "weight_load_s": 0.0}
    steps = []
    for seed in SEEDS:
        if mode is None:
            run = simulate_sync(cluster, work, steps=STEPS, seed=seed, **kwargs)
            steps.append(run.step_s(WARMUP) * time_scale)
        else:
            placement, eta, _ = mode
            # In flight: what the staleness bound admits, (η + 1) batches, as areal.max_concurrent_rollouts' default
            # is (and verl's prefetch window); the simulator's own default holds back all but what the KV cache
            # holds, which a run does not: its requests queue in the engine.
            run = simulate_async(
                cluster, work, eta, STEPS, seed=seed, colocated=placement == "colocated",
                max_concurrent_groups=int((eta + 1) * work.batch), **kwargs,
            )  # fmt: skip
            steps.append(run.step_s(WARMUP) * time_scale)
    return statistics.fmean(steps)


def generation_bound_step_s(bench: dict, engines: int = 1) -> float:
    """The engines' step with nothing in the way, in this box's seconds: a step's answers decoded at the rate of a
    full KV cache (as many mean-length answers running as the cache holds, each half done on average), plus their
    prompts' prefill; ``engines`` share the work."""
    time_scale = bench["time_scale"]["time_scale"]
    cluster, work = _stand_in(bench, engines, separate=False)
    engine = cluster.engine()
    running = max(1, int(engine.kv_capacity_tokens // (work.prompt + work.response_mean)))
    context = running * (work.prompt + work.response_mean / 2)
    tokens_per_s = engines * running / engine.decode.step_s(running, context)
    answers = work.batch * work.group
    decode = answers * work.response_mean / tokens_per_s
    prefill = engine.prefill_time(answers * work.prompt, answers * work.prompt**2) / engines
    return (decode + prefill) * time_scale


def trainer_busy_s(row: dict) -> float:
    """A row's trainer seconds per step, measured: its step less the time it waited for samples (our rows'
    ``trainer_idle_ratio``; verl's trainers time that wait as the step's ``gen`` phase)."""
    if "trainer_idle_ratio" in row:
        return row["step_s_median"]["median"] * (1 - row["trainer_idle_ratio"]["median"])
    return row["train_s_median"]["median"]


def compare(bench: dict) -> dict:
    """Predicted against measured speedup for every row of a gpu-shaped ``bench.json``, and the physical limit."""
    rows = {row["config"]: row for row in bench["rows"]}
    sync = rows["sync"]
    sync_train = sync["train_s_median"]["median"]
    predicted_sync = simulated_step_s(bench, None, sync_train)
    measured_sync = sync["step_s_median"]["median"]
    limits: dict[tuple[str, int], float] = {}
    out = []
    for name, row in rows.items():
        mode = row_mode(name, row.get("overrides", []))
        placement, engines = ("colocated", 1) if mode is None else (mode[0], mode[2])
        if (placement, engines) not in limits:
            generation = generation_bound_step_s(bench, engines)
            limits[placement, engines] = (
                sync_train + generation if placement == "colocated" else max(sync_train, generation)
            )
        limit_speedup = measured_sync / limits[placement, engines]
        entry = {"config": name, "placement": placement, "engines": engines, "limit_speedup": limit_speedup}
        if mode is None:
            entry |= {"predicted_step_s": predicted_sync, "measured_step_s": measured_sync}
        else:
            train = trainer_busy_s(row)
            predicted = predicted_sync / simulated_step_s(bench, mode, train)
            measured = row["speedup"]["median"]
            entry |= {
                "eta": mode[1],
                "trainer_busy_s": train,
                "predicted_speedup": predicted,
                "measured_speedup": measured,
                "measured_speedup_min": row["speedup"]["min"],
                "measured_speedup_max": row["speedup"]["max"],
                "error": predicted / measured - 1,
                "within_tolerance": abs(predicted / measured - 1) <= TOLERANCE,
                "of_limit": measured / limit_speedup,
            }
        out.append(entry)
    return {"tolerance": TOLERANCE, "rows": out}


def format_table(result: dict) -> str:
    lines = [
        "| row | measured speedup (min-max) | planner | error | physical limit | of limit |",
        "|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        if "measured_speedup" not in r:
            lines.append(
                f"| {r['config']} | 1 (step {r['measured_step_s']:.2f} s) | step {r['predicted_step_s']:.2f} s | "
                f"{r['predicted_step_s'] / r['measured_step_s'] - 1:+.0%} | {r['limit_speedup']:.2f}x | - |"
            )
            continue
        lines.append(
            f"| {r['config']} | {r['measured_speedup']:.2f}x ({r['measured_speedup_min']:.2f}-"
            f"{r['measured_speedup_max']:.2f}) | {r['predicted_speedup']:.2f}x | {r['error']:+.0%} | "
            f"{r['limit_speedup']:.2f}x | {r['of_limit']:.0%} |"
        )
    return "\n".join(lines)


def rows_table(bench: dict, result: dict) -> str:
    """The bench's rows for the results page: trained tokens per second, speedup over sync, staleness, where the
    trainer waited, and the fraction of the physical limit (medians, min-max over the repeats)."""
    limits = {r["config"]: r for r in result["rows"]}
    lines = [
        "| row | trained tokens/s | speedup over sync | token staleness (mean) | trainer waiting "
        "| of the physical limit |",
        "|---|---|---|---|---|---|",
    ]
    for row in bench["rows"]:
        cost = row["s_per_1k_tokens"]
        rate = f"{1000 / cost['median']:.0f} ({1000 / cost['max']:.0f}-{1000 / cost['min']:.0f})"
        speedup = row.get("speedup")
        gain = "1" if speedup is None else f"{speedup['median']:.2f}x ({speedup['min']:.2f}-{speedup['max']:.2f})"
        # One definition for every row (areal_bench.token_staleness); "-" for a run from before its records.
        stale = row.get("token_staleness_mean")
        staleness = "-" if stale is None or stale.get("median") is None else f"{stale['median']:.2f}"
        # Ours report the wait for samples; verl's trainers time it as their step's "gen" phase.
        idle = row.get("trainer_idle_ratio")
        if idle:
            waiting = f"{idle['median']:.0%}"
        elif "gen_s_median" in row:
            waiting = f"{row['gen_s_median']['median'] / row['step_s_median']['median']:.0%}"
        else:
            waiting = "-"
        of_limit = limits[row["config"]].get("of_limit")
        lines.append(
            f"| {row['config']} | {rate} | {gain} | {staleness} | {waiting} | "
            f"{'-' if of_limit is None else f'{of_limit:.0%}'} |"
        )
    return "\n".join([*lines, "", bench.get("staleness_definition", STALENESS_DEFINITION)])


def plot(bench: dict, result: dict, out: Path) -> None:
    """Measured speedup over sync per row (median, min-max), the planner's prediction, the physical limits."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["rows"] if "measured_speedup" in r]
    names = [r["config"] for r in rows]
    medians = [r["measured_speedup"] for r in rows]
    errors = [
        [m - r["measured_speedup_min"] for m, r in zip(medians, rows, strict=True)],
        [r["measured_speedup_max"] - m for m, r in zip(medians, rows, strict=True)],
    ]
    figure, axes = plt.subplots(figsize=(11, 4.8))
    colors = ["#dd8452" if n.startswith("verl-") else "#4c72b0" for n in names]  # orange: verl's, blue: ours
    axes.bar(range(len(rows)), medians, yerr=errors, capsize=4, color=colors, label="measured (median, min-max)")
    axes.scatter(range(len(rows)), [r["predicted_speedup"] for r in rows], marker="D", color="black", zorder=3,
                 label="planner (from each row's measured trainer)")  # fmt: skip
    for i, r in enumerate(rows):  # each row's physical limit: its placement's
        axes.hlines(
            r["limit_speedup"], i - 0.4, i + 0.4, color="#c44e52", ls="--", label="physical limit" if i == 0 else None
        )
    axes.axhline(1.0, color="grey", lw=0.8)
    axes.set_ylim(0, 1.25 * max(r["limit_speedup"] for r in rows))  # room for the legend above the limits
    axes.set_xticks(range(len(rows)), names, rotation=30, ha="right")
    axes.set_ylabel("trained tokens/s over synchronous verl")
    scale = bench["time_scale"]
    axes.set_title(
        f"GPU-shaped engines ({scale['case']}, time scale {scale['time_scale']:.2f}), tiny trainer on 2 CPU cores; "
        f"{bench['repeats']} repeats"
    )
    axes.legend(loc="upper left", fontsize=8)
    figure.tight_layout()
    figure.savefig(out, dpi=110)
    plt.close(figure)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tools/bench_vs_planner.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("bench", type=Path, help="a bench.json written by tools/bench.py --workload gpu-shaped")
    args = parser.parse_args(argv)
    bench = json.loads(args.bench.read_text())
    if bench.get("workload") != "gpu-shaped":
        parser.error(f"{args.bench}: workload {bench.get('workload')!r}; the planner models only gpu-shaped runs")
    result = compare(bench)
    (args.bench.parent / "planner.json").write_text(json.dumps(result, indent=2))
    plot(bench, result, args.bench.parent / "planner.png")
    print(rows_table(bench, result))
    print()
    print(format_table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
