"""Soak run: async training on CPU for a long while, with frequent interrupts, memory tracked.

Starts ``areal-plugins train`` on a recipe (default: the main job's, ``recipes/grpo_cpu_async.yaml``), samples
the resident memory of the whole process tree every ``--sample-every`` seconds and compares it cycle by cycle
(``--cycle-every`` seconds), and at the end checks the run's accounting (submitted = accepted + rejected +
running; accepted = consumed + buffered) and every consumed sample's staleness against η.

Engine kills are off by default (``--kill-every 0``): they need a backend that restarts a killed engine, and
none does now (with verl's ``vllm`` a dead replica stops the run). ``--kill-every S`` SIGKILLs a process with
``vllm.entrypoints.openai.api_server`` in its command line every S seconds: the server process of the retired
``areal_vllm`` backend, which restarted it (the committed ``docs/results/soak*.json`` were measured that way).
With kills, the memory cycles run from kill to kill.

Writes ``soak.json`` (memory samples, growth, steps, kills, accounting) in the run directory.

Run: ``.venv/bin/python tools/soak.py --minutes 30 --steps 300`` (the figures in the issue note came from
the command printed at the top of ``soak.json``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import psutil


def tree_memory_mb(root: psutil.Process) -> tuple[float, dict[str, float]]:
    """Total RSS of the process tree, and PSS per process name (PSS splits shared pages among the processes
    that map them, so a leak shows in one name instead of in every forked worker)."""
    rss = 0.0
    pss: dict[str, float] = {}
    for process in [root, *root.children(recursive=True)]:
        try:
            name = process.name()
            memory = process.memory_full_info()
        except psutil.Error:
            continue
        rss += memory.rss / 2**20
        pss[name] = pss.get(name, 0.0) + memory.pss / 2**20
    return rss, {k: round(v, 1) for k, v in pss.items()}


def vllm_servers(root: psutil.Process) -> list[psutil.Process]:
    found = []
    for process in root.children(recursive=True):
        try:
            if "vllm.entrypoints.openai.api_server" in " ".join(process.cmdline()):
                found.append(process)
        except psutil.Error:
            continue
    return found


def count_lines(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


def lost_groups(accounting: dict) -> int:
    """Accepted groups neither trained nor still buffered at the end (must be 0)."""
    return accounting["accepted"] - accounting["consumed"] - accounting["buffered"]


def cycles(samples: list[dict], kills: list[float]) -> list[tuple[float, list[dict]]]:
    """The samples between consecutive server kills, with each cycle's start."""
    return [(start, [s for s in samples if start <= s["t_s"] < end]) for start, end in itertools.pairwise(kills)]


def cycle_peaks(samples: list[dict], kills: list[float]) -> list[dict]:
    """Peak process-tree RSS between consecutive server kills (a restart frees the server's memory, so the
    tree's RSS is a sawtooth; its peaks are what a leak would raise)."""
    peaks = []
    for start, cycle in cycles(samples, kills):
        if cycle:
            peaks.append({"from_s": start, "peak_mb": max(s["rss_mb"] for s in cycle)})
    return peaks


def slope_per_hour(seconds: list[float], values: list[float]) -> float | None:
    """Least-squares slope of ``values`` over time, per hour."""
    if len(values) < 2:
        return None
    xs = [t / 3600 for t in seconds]
    mx, my = statistics.mean(xs), statistics.mean(values)
    return sum((x - mx) * (y - my) for x, y in zip(xs, values, strict=True)) / sum((x - mx) ** 2 for x in xs)


def slope_mb_per_hour(peaks: list[dict]) -> float | None:
    """Least-squares slope of the cycle peaks over time."""
    return slope_per_hour([p["from_s"] for p in peaks], [p["peak_mb"] for p in peaks])


def role(name: str) -> str:
    """A process's role: Ray retitles an actor's process with the method it runs (``ray::X.method``)."""
    return re.sub(r"^(ray::\w+)\..*$", r"\1", name)


def pss_per_cycle(samples: list[dict], kills: list[float]) -> dict[str, list[float]]:
    """Per process role, its median PSS (MB) in each cycle between server kills."""
    by_role: list[list[dict[str, float]]] = []
    for _, cycle in cycles(samples, kills):
        rows = []
        for sample in cycle:
            row: dict[str, float] = {}
            for name, mb in sample.get("pss_by_process", {}).items():
                row[role(name)] = row.get(role(name), 0.0) + mb
            rows.append(row)
        by_role.append(rows)
    roles = sorted({name for rows in by_role for row in rows for name in row})
    return {
        name: [round(statistics.median(row.get(name, 0.0) for row in rows), 1) for rows in by_role if rows]
        for name in roles
    }


def growing(per_cycle: dict[str, list[float]], kills: list[float], threshold: float = 20.0) -> dict[str, float]:
    """Roles whose PSS rose faster than ``threshold`` MB/h over the cycles after the first (the first holds
    warm-up: caches, allocator pools), fastest first."""
    rates = {name: slope_per_hour(kills[1 : len(values)], values[1:]) for name, values in per_cycle.items()}
    kept = {name: round(rate, 1) for name, rate in rates.items() if rate is not None and rate > threshold}
    return dict(sorted(kept.items(), key=lambda kv: -kv[1]))


def add_pss_totals(report: dict) -> None:
    """The tree's PSS per cycle (shared pages counted once) and its slope after the warm-up cycle: the leak
    figure RSS peaks cannot give (they count shared pages per process and depend on when a sample lands)."""
    per_cycle, kills = report["pss_mb_per_cycle"], report.get("cycle_starts", report["server_kills"])
    cycles = max((len(values) for values in per_cycle.values()), default=0)
    totals = [round(sum(values[i] for values in per_cycle.values() if i < len(values)), 1) for i in range(cycles)]
    report["pss_total_mb_per_cycle"] = totals
    report["pss_total_slope_mb_per_hour_after_warmup"] = slope_per_hour(kills[1:cycles], totals[1:])
    report["growing_processes_mb_per_hour"] = growing(per_cycle, kills)


def plot(report: dict, out: Path) -> None:
    """Process-tree memory over the run (server kills marked), and the PSS of the roles that grew."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (axis, roles_axis) = plt.subplots(1, 2, figsize=(14, 3.8), gridspec_kw={"width_ratios": [3, 2]})
    samples = report["samples"]
    axis.plot([s["t_s"] / 60 for s in samples], [s["rss_mb"] / 1024 for s in samples], color="#4c72b0")
    for i, t in enumerate(report["server_kills"]):
        axis.axvline(t / 60, color="#c44e52", lw=0.8, ls="--", label="vLLM server SIGKILLed" if i == 0 else None)
    axis.set_xlabel("minutes")
    axis.set_ylabel("RSS of the process tree (GiB)")
    axis.set_title(
        f"soak: {report['steps']} steps, {len(report['server_kills'])} kills, "
        f"{report['engine_restarts'] or 0:.0f} restarts; tree PSS after warm-up "
        f"{report.get('pss_total_slope_mb_per_hour_after_warmup') or 0:+.0f} MB/h"
    )
    axis.legend(loc="lower right")
    per_cycle = report.get("pss_mb_per_cycle", {})
    shown = (
        list(report.get("growing_processes_mb_per_hour", {}))[:4]
        or sorted(per_cycle, key=lambda n: -per_cycle[n][-1])[:4]
    )
    starts = [k / 60 for k in report.get("cycle_starts", report["server_kills"])]
    for name in shown:
        roles_axis.plot(starts[: len(per_cycle[name])], per_cycle[name], marker="o", label=name)
    roles_axis.set_xlabel("cycle start (minutes)")
    roles_axis.set_ylabel("median PSS in the cycle (MB)")
    roles_axis.set_title("processes whose memory grew (PSS: shared pages split)")
    roles_axis.legend(loc="best", fontsize=8)
    figure.tight_layout()
    figure.savefig(out, dpi=110)
    plt.close(figure)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="recipes/grpo_cpu_async.yaml")
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--max-staleness", type=int, default=1, help="small: weight updates interrupt often")
    parser.add_argument("--batch", type=int, default=8, help="prompts per step (small: many steps and updates)")
    parser.add_argument("--rss-growth-bound-mb", type=float, default=300.0, help="allowed warm-phase growth")
    parser.add_argument(
        "--kill-every",
        type=float,
        default=0.0,
        help="seconds between kills of a vLLM api_server process (0, the default: none); only the retired "
        "areal_vllm backend started one and restarted it, so with today's backends nothing is killed",
    )
    parser.add_argument("--cycle-every", type=float, default=180.0, help="memory cycle length when nothing is killed")
    parser.add_argument("--sample-every", type=float, default=10.0)
    parser.add_argument("--run-dir", type=Path, default=Path("runs/soak"))
    args = parser.parse_args()
    command = [
        str(Path(sys.executable).with_name("areal-plugins")), "train", args.recipe,
        f"trainer.total_training_steps={args.steps}", "trainer.val_before_train=false", "trainer.test_freq=-1",
        f"areal.max_staleness={args.max_staleness}", f"data.train_batch_size={args.batch}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={args.batch}", "--run-dir", str(args.run_dir),
    ]  # fmt: skip
    print("soak:", " ".join(command), flush=True)
    runner = subprocess.Popen(command, start_new_session=True)
    root = psutil.Process(runner.pid)
    started = time.monotonic()
    deadline = started + args.minutes * 60
    next_kill = started + args.kill_every if args.kill_every > 0 else float("inf")
    samples, kills = [], []
    while runner.poll() is None and time.monotonic() < deadline:
        time.sleep(args.sample_every)
        now = time.monotonic() - started
        total, pss_by_name = tree_memory_mb(root)
        samples.append({"t_s": round(now, 1), "rss_mb": round(total, 1), "pss_by_process": pss_by_name})
        servers = vllm_servers(root)
        if servers and time.monotonic() >= next_kill:
            os.killpg(servers[0].pid, signal.SIGKILL)
            kills.append(round(now, 1))
            next_kill = time.monotonic() + args.kill_every
            print(f"soak: {now:.0f} s: killed the vLLM server (pid {servers[0].pid})", flush=True)
        steps_done = count_lines(args.run_dir / "areal_steps.jsonl")
        print(f"soak: {now:.0f} s: step {steps_done}, process tree {samples[-1]['rss_mb']:.0f} MB", flush=True)
    if runner.poll() is None:  # time is up: stop the run (its accounting is not written then)
        print(f"soak: --minutes {args.minutes} ran out before --steps {args.steps}: no final accounting", flush=True)
        os.killpg(runner.pid, signal.SIGTERM)
        runner.wait(timeout=120)
    steps = [json.loads(line) for line in (args.run_dir / "areal_steps.jsonl").read_text().splitlines()]
    consumed = [json.loads(line) for line in (args.run_dir / "areal_samples.jsonl").read_text().splitlines()]
    accounting_path = args.run_dir / "areal_accounting.jsonl"
    accounting = json.loads(accounting_path.read_text().splitlines()[-1]) if accounting_path.exists() else None
    # Memory is compared cycle by cycle: from kill to kill, or every --cycle-every seconds without kills.
    elapsed = samples[-1]["t_s"] if samples else 0.0
    marks = kills or [i * args.cycle_every for i in range(1, int(elapsed // args.cycle_every) + 1)]
    peaks = cycle_peaks(samples, marks)
    growth = peaks[-1]["peak_mb"] - peaks[0]["peak_mb"] if peaks else None
    train_log = (args.run_dir / "train.log").read_text(errors="replace")
    report = {
        "command": " ".join(command),
        "minutes": (time.monotonic() - started) / 60,
        "steps": len(steps),
        "server_kills": kills,
        "cycle_starts": marks,
        "staleness_max": max((s["trainer_version"] - s["head_version"] for s in consumed), default=None),
        "consumed_trajectories": len(consumed),
        "duplicate_consumptions": len(consumed) - len({(s["group"], s["key"]) for s in consumed}),
        "accounting": accounting,
        "completed": runner.returncode == 0,
        "engine_restarts": steps[-1].get("areal/engine_restarts") if steps else None,
        "restart_warnings_in_log": train_log.count("restarting it"),
        "interrupted_trajectories": sum(1 for s in consumed if s["num_interrupts"] > 0),
        "multi_version_trajectories": sum(1 for s in consumed if s["head_version"] != s["tail_version"]),
        "lost_groups": None if accounting is None else lost_groups(accounting),
        "rss_mb_first": samples[0]["rss_mb"] if samples else None,
        "rss_mb_peak": max((s["rss_mb"] for s in samples), default=None),
        "rss_cycle_peaks": peaks,
        "rss_growth_mb": growth,  # last full cycle's peak - first full cycle's peak
        "rss_slope_mb_per_hour": slope_mb_per_hour(peaks),
        "rss_growth_bound_mb": args.rss_growth_bound_mb,
        "rss_within_bound": growth is not None and growth <= args.rss_growth_bound_mb,
        "pss_mb_per_cycle": pss_per_cycle(samples, marks),
        "samples": [{"t_s": s["t_s"], "rss_mb": s["rss_mb"]} for s in samples],
    }
    add_pss_totals(report)
    (args.run_dir / "soak.json").write_text(json.dumps(report, indent=2))
    plot(report, args.run_dir / "soak.png")
    print(json.dumps({k: v for k, v in report.items() if k not in ("samples", "pss_mb_per_cycle")}, indent=2))


if __name__ == "__main__":
    main()
