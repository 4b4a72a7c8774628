"""Does staleness hurt, and does the decoupled objective help? The paper's ablation on the CPU task.

Two steps, each a series of real ``areal-plugins train`` runs of the tiny model (separate placement, so
generation runs ahead of the trainer and consumed samples reach η versions of staleness):

``python tools/ablation.py drift``
    short decoupled runs at a high η over a grid of learning rate x optimizer steps per batch
    (``ppo_mini_batch_size``); per setting the drift stale samples carry: KL(π_prox‖π_behav) per token,
    the largest behaviour weight w = π_prox/π_behav, the fraction of tokens the cap masks, the staleness
    reached. The candidate regime is the setting with the largest KL whose run did not collapse
    (last-3-step train reward not below the first 3): chosen by the drift, not by the result. At a high
    η the early steps train on samples of the first policy, so this check is weak; ``run`` checks the
    candidate where it matters (its η = 0 arm must not lose validation accuracy) and stops otherwise:
    then take the next setting. Writes ``docs/results/ablation_drift.json``.

``python tools/ablation.py run --lr LR --mini-batch MB``
    η in ``--etas`` x objective (decoupled PPO; standard PPO against the behaviour policy,
    ``areal.loss.decoupled=false``; M2PO, the opt-in plugin, at the η values of ``--m2po-etas``) x
    ``--seeds``, the same steps; greedy validation accuracy every ``--test-freq`` steps and the train
    reward. Writes ``docs/results/ablation.json`` and ``ablation.png`` (a panel per η: each objective's
    seed mean with its min-max band).

``python tools/ablation.py guarantee``
    what η guarantees per sample: placement x η x ``areal.on_stale`` (wait: admission's count bound
    only; reissue: a group past η at consumption is generated again) on the long-tail workload, where
    interrupted trajectories mix versions; per run the share of trained trajectories whose staleness
    (trainer version - oldest token's version) exceeds η, the largest excess, the groups generated
    again. Writes ``docs/results/staleness_guarantee.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from repeats import spread

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "docs" / "results"
RECIPE = REPO / "recipes" / "grpo_cpu_async_separate.yaml"
PLACEMENT_RECIPES = {"colocated": REPO / "recipes" / "grpo_cpu_async.yaml", "separate": RECIPE}
LONGTAIL = (REPO / ".areal" / "tiny_longtail", ["data.max_response_length=224"])  # as tools/bench.py
REWARD_KEY = "critic/score/mean"
VALIDATION_PREFIX = "val-core/"
#: Objective -> the recipe overrides that select it.
OBJECTIVES = {
    "decoupled": ["areal.loss.decoupled=true"],
    "standard": ["areal.loss.decoupled=false"],
    # M2PO masks by the second moment instead of capping w: verl's cap is turned off for it.
    "m2po": ["areal.loss.decoupled=true", "areal.loss.behav_imp_weight_cap=null", "areal.plugins.include=[m2po]"],
}
#: Our loss's statistics reach verl's metrics under the actor's prefix.
DRIFT_KEYS = {
    "kl_prox_behav": "actor/areal/approx_kl_prox_behav",
    "w_max": "actor/areal/behav_imp_weight_max",
    "capped_frac": "actor/areal/behav_imp_weight_capped_frac",
    "staleness_mean": "areal/staleness_mean",
    "staleness_max": "areal/staleness_max",
    "clip_frac": "actor/pg_clipfrac",
}


#: ``--reuse``: a run directory whose metrics reached the last step is read, not trained again.
REUSE = False


def train(run_dir: Path, overrides: list[str], tiny_dir: Path, recipe: Path = RECIPE) -> list[dict[str, Any]]:
    """One run; its metrics lines (``{"step", "data"}``)."""
    steps = next(int(o.split("=")[1]) for o in overrides if o.startswith("trainer.total_training_steps="))
    metrics = run_dir / "metrics.jsonl"
    if REUSE and metrics.exists() and max((row["step"] for row in read_metrics(metrics)), default=0) >= steps:
        print(f"  {run_dir.name}: reused", flush=True)
        return read_metrics(metrics)
    command = [sys.executable, "-m", "areal_plugins.cli", "train", str(recipe), *overrides]
    command += ["--run-dir", str(run_dir), "--tiny-dir", str(tiny_dir)]
    started = time.monotonic()
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"run {run_dir.name} failed (exit {result.returncode}); see {run_dir / 'train.log'}")
    print(f"  {run_dir.name}: {time.monotonic() - started:.0f} s", flush=True)
    return read_metrics(run_dir / "metrics.jsonl")


def read_metrics(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def series(rows: list[dict[str, Any]], key: str) -> list[tuple[int, float]]:
    return [(int(row["step"]), float(row["data"][key])) for row in rows if key in row["data"]]


def validation_accuracy(rows: list[dict[str, Any]]) -> list[tuple[int, float]]:
    """Greedy validation accuracy by step (the first ``val-core/`` metric: one data source here)."""
    for row in rows:
        keys = sorted(k for k in row["data"] if k.startswith(VALIDATION_PREFIX))
        if keys:
            return series(rows, keys[0])
    return []


def drift(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Mean of each drift metric over the steps that carry it (``w_max``, ``staleness_max``: the largest)."""
    out = {}
    for name, key in DRIFT_KEYS.items():
        values = [value for _, value in series(rows, key)]
        if values:
            out[name] = max(values) if name.endswith("_max") else statistics.mean(values)
    return out


def learns(rewards: list[float], window: int = 3) -> bool:
    return len(rewards) >= 2 * window and statistics.mean(rewards[-window:]) >= statistics.mean(rewards[:window])


def choose_regime(settings: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The setting with the largest KL(π_prox‖π_behav) among those whose run still learns."""
    candidates = [s for s in settings if s["learns"] and "kl_prox_behav" in s["drift"]]
    return max(candidates, key=lambda s: s["drift"]["kl_prox_behav"], default=None)


#: GRPO group size of the CPU recipes (recipes/_cpu_grpo_tiny.yaml, rollout.n): a mini-batch of ``m``
#: prompts holds ``m x ROLLOUT_N`` samples, and verl's micro-batch must divide it.
ROLLOUT_N = 8


def common_overrides(args: argparse.Namespace, eta: int, lr: float, mini_batch: int, seed: int) -> list[str]:
    return [
        f"trainer.total_training_steps={args.steps}",
        f"areal.max_staleness={eta}",
        f"actor_rollout_ref.actor.optim.lr={lr}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={mini_batch}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={min(64, mini_batch * ROLLOUT_N)}",
        f"data.seed={seed}",
        f"actor_rollout_ref.rollout.seed={seed}",
    ]


def run_drift(args: argparse.Namespace) -> int:
    settings = []
    for lr in args.lrs:
        for mini_batch in args.mini_batches:
            name = f"drift-eta{args.eta}-lr{lr}-mb{mini_batch}"
            overrides = common_overrides(args, args.eta, lr, mini_batch, seed=0)
            overrides += ["trainer.val_before_train=false", "trainer.test_freq=-1", *OBJECTIVES["decoupled"]]
            rows = train(args.work / name, overrides, args.tiny_dir)
            if not series(rows, DRIFT_KEYS["kl_prox_behav"]):
                raise RuntimeError(f"{name} logged no {DRIFT_KEYS['kl_prox_behav']}: the drift cannot be judged")
            rewards = [value for _, value in series(rows, REWARD_KEY)]
            settings.append(
                {
                    "lr": lr,
                    "mini_batch": mini_batch,
                    "drift": drift(rows),
                    "rewards": rewards,
                    "learns": learns(rewards),
                }
            )
            print(f"  lr {lr} mini-batch {mini_batch}: {settings[-1]['drift']}", flush=True)
    chosen = choose_regime(settings)
    report = {"eta": args.eta, "steps": args.steps, "objective": "decoupled", "settings": settings, "chosen": chosen}
    (args.out / "ablation_drift.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"chosen: {chosen and {k: chosen[k] for k in ('lr', 'mini_batch')}}")
    return 0


def run_ablation(args: argparse.Namespace) -> int:
    path = args.out / "ablation.json"
    report: dict[str, Any] = json.loads(path.read_text()) if path.exists() and args.resume else {}
    report.update({"lr": args.lr, "mini_batch": args.mini_batch, "steps": args.steps, "test_freq": args.test_freq})
    runs = report.setdefault("runs", {})
    for seed in range(args.seeds):
        for eta in args.etas:
            for objective in args.objectives:
                if objective == "m2po" and eta not in args.m2po_etas:
                    continue
                name = f"eta{eta}-{objective}-seed{seed}"
                if name in runs:
                    continue
                overrides = common_overrides(args, eta, args.lr, args.mini_batch, seed)
                overrides += ["trainer.val_before_train=true", f"trainer.test_freq={args.test_freq}"]
                rows = train(args.work / name, overrides + OBJECTIVES[objective], args.tiny_dir)
                if eta == 0 and objective == "decoupled" and seed == 0:
                    check_learns_synchronously(validation_accuracy(rows), args)
                runs[name] = {
                    "eta": eta,
                    "objective": objective,
                    "seed": seed,
                    "validation": validation_accuracy(rows),
                    "reward": series(rows, REWARD_KEY),
                    "drift": drift(rows),
                    "staleness": staleness_excess(read_metrics(args.work / name / "areal_samples.jsonl"), eta),
                }
                report["summary"] = summarize(runs, args.window)
                path.write_text(json.dumps(report, indent=2) + "\n")
    plot(report, args.out / "ablation.png")
    for key, row in report["summary"].items():
        print(f"{key}: {row}")
    return 0


def staleness_excess(samples: list[dict[str, Any]], eta: int) -> dict[str, float]:
    """From ``areal_samples.jsonl``: how many trained trajectories were older than η, and by how much."""
    excess = [s["trainer_version"] - s["head_version"] - eta for s in samples]
    over = [e for e in excess if e > 0]
    return {
        "trajectories": len(samples),
        "over_eta_fraction": len(over) / len(samples) if samples else 0.0,
        "max_excess": float(max(over, default=0)),
        "interrupted_fraction": sum(s["num_interrupts"] > 0 for s in samples) / len(samples) if samples else 0.0,
    }


def run_guarantee(args: argparse.Namespace) -> int:
    tiny_dir, workload = LONGTAIL
    build = ["build-tiny", "--out", str(tiny_dir), "--workload", "longtail"]  # a no-op once built (~3 min before)
    subprocess.run([sys.executable, "-m", "areal_plugins.cli", *build], cwd=REPO, check=True)
    results = []
    for placement in args.placements:
        for eta in args.etas:
            for mode in args.modes:
                name = f"guarantee-{placement}-eta{eta}-{mode}"
                overrides = [
                    f"trainer.total_training_steps={args.steps}",
                    f"areal.max_staleness={eta}",
                    f"areal.on_stale={mode}",
                    "trainer.val_before_train=false",
                    "trainer.test_freq=-1",
                    *workload,
                ]
                rows = train(args.work / name, overrides, tiny_dir, PLACEMENT_RECIPES[placement])
                samples = read_metrics(args.work / name / "areal_samples.jsonl")
                last = rows[-1]["data"]
                results.append(
                    {"placement": placement, "eta": eta, "on_stale": mode}
                    | staleness_excess(samples, eta)
                    | {
                        "reissued_stale_groups": last.get("areal/reissued_stale_groups", 0.0),
                        "final_reward": statistics.mean(v for _, v in series(rows, REWARD_KEY)[-3:]),
                        "seconds_per_step": statistics.mean(v for _, v in series(rows, "timing_s/step")),
                    }
                )
                print(f"  {results[-1]}", flush=True)
                (args.out / "staleness_guarantee.json").write_text(
                    json.dumps({"steps": args.steps, "workload": "longtail", "runs": results}, indent=2) + "\n"
                )
    return 0


#: Validation accuracy the synchronous (η = 0) run may lose before the regime counts as not learning.
SYNC_LOSS_LIMIT = 0.05


def check_learns_synchronously(validation: list[tuple[int, float]], args: argparse.Namespace) -> None:
    """Stop when the regime's η = 0 run loses validation accuracy: staleness cannot be judged there."""
    if len(validation) >= 2 and validation[-1][1] < validation[0][1] - SYNC_LOSS_LIMIT:
        raise SystemExit(
            f"lr {args.lr} with {args.mini_batch} prompts per optimizer step does not learn even at η = 0 "
            f"(validation accuracy {validation[0][1]:.3f} -> {validation[-1][1]:.3f}): choose the next setting "
            "of ablation_drift.json"
        )


def summarize(runs: dict[str, Any], window: int) -> dict[str, Any]:
    """Per (η, objective): final validation accuracy and last-``window`` train reward, over seeds."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for run in runs.values():
        groups.setdefault(f"eta{run['eta']}-{run['objective']}", []).append(run)
    summary = {}
    for key, members in sorted(groups.items()):
        finals = [run["validation"][-1][1] for run in members if run["validation"]]
        rewards = [statistics.mean(v for _, v in run["reward"][-window:]) for run in members if run["reward"]]
        kls = [run["drift"]["kl_prox_behav"] for run in members if "kl_prox_behav" in run["drift"]]
        past_eta = [run["staleness"]["over_eta_fraction"] for run in members if "staleness" in run]
        summary[key] = {
            "seeds": len(members),
            "final_validation": spread(finals, centre="mean", count=None) if finals else None,
            "final_reward": spread(rewards, centre="mean", count=None) if rewards else None,
            "kl_prox_behav": spread(kls, centre="mean", count=None) if kls else None,
            "trajectories_past_eta": spread(past_eta, centre="mean", count=None) if past_eta else None,
        }
    return summary


def plot(report: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = list(report["runs"].values())
    etas = sorted({run["eta"] for run in runs})
    figure, axes = plt.subplots(1, len(etas), figsize=(4.2 * len(etas), 3.8), sharey=True, squeeze=False)
    colours = {"decoupled": "#4c72b0", "standard": "#dd8452", "m2po": "#55a868"}
    for axis, eta in zip(axes[0], etas, strict=True):
        for objective, colour in colours.items():
            members = [run for run in runs if run["eta"] == eta and run["objective"] == objective and run["validation"]]
            if not members:
                continue
            steps = [step for step, _ in members[0]["validation"]]
            columns = list(zip(*[[value for _, value in run["validation"]] for run in members], strict=False))
            means = [statistics.mean(column) for column in columns]
            axis.plot(steps[: len(means)], means, color=colour, marker="o", label=f"{objective} ({len(members)} seeds)")
            axis.fill_between(
                steps[: len(means)], [min(c) for c in columns], [max(c) for c in columns], color=colour, alpha=0.2
            )
        axis.set_title(f"η = {eta}")
        axis.set_xlabel("training step")
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
    axes[0][0].set_ylabel("greedy validation accuracy")
    figure.suptitle(f"lr {report['lr']}, {report['mini_batch']} prompts per optimizer step; band: seed min-max")
    figure.tight_layout()
    figure.savefig(out, dpi=110)


def spread_cell(value: dict[str, float] | None, digits: int = 3) -> str:
    """``mean (min-max)`` of a :func:`repeats.spread` taken with ``centre="mean"``, or ``-`` when there is none."""
    if value is None:
        return "-"
    return f"{value['mean']:.{digits}f} ({value['min']:.{digits}f}-{value['max']:.{digits}f})"


def markdown_tables(results: Path) -> str:
    """The tables of docs/results/ablation.md, from the committed JSON files (every number comes from them)."""
    lines = []
    drift_path = results / "ablation_drift.json"
    if drift_path.exists():
        report = json.loads(drift_path.read_text())
        lines += [
            f"Drift at η = {report['eta']} ({report['steps']} steps, decoupled objective):",
            "",
            "| lr | prompts per optimizer step | KL(π_prox‖π_behav) per token | max w | tokens capped | learns |",
            "|---|---|---|---|---|---|",
        ]
        for setting in report["settings"]:
            d = setting["drift"]
            lines.append(
                f"| {setting['lr']:g} | {setting['mini_batch']} | {d.get('kl_prox_behav', 0):.3f} | "
                f"{d.get('w_max', 0):.2f} | {100 * d.get('capped_frac', 0):.2f}% | "
                f"{'yes' if setting['learns'] else 'no'} |"
            )
        lines.append("")
    ablation_path = results / "ablation.json"
    if ablation_path.exists():
        report = json.loads(ablation_path.read_text())
        lines += [
            "| η | objective | seeds | final greedy validation accuracy, mean (min-max) | "
            "train reward, last steps | KL(π_prox‖π_behav) | trajectories past η |",
            "|---|---|---|---|---|---|---|",
        ]
        for key, row in sorted(report["summary"].items(), key=lambda kv: (int(kv[0].split("-")[0][3:]), kv[0])):
            eta, objective = key.split("-", 1)

            lines.append(
                f"| {eta[3:]} | {objective} | {row['seeds']} | {spread_cell(row['final_validation'])} | "
                f"{spread_cell(row['final_reward'])} | {spread_cell(row['kl_prox_behav'])} | "
                f"{spread_cell(row.get('trajectories_past_eta'), 2)} |"
            )
        lines.append("")
    guarantee_path = results / "staleness_guarantee.json"
    if guarantee_path.exists():
        report = json.loads(guarantee_path.read_text())
        lines += [
            "| placement | η | on_stale | trajectories past η | largest excess | groups generated again | "
            "interrupted | s per step | final reward |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for run in report["runs"]:
            lines.append(
                f"| {run['placement']} | {run['eta']} | {run['on_stale']} | {100 * run['over_eta_fraction']:.1f}% | "
                f"{run['max_excess']:.0f} | {run['reissued_stale_groups']:.0f} | "
                f"{100 * run['interrupted_fraction']:.0f}% | {run['seconds_per_step']:.1f} | "
                f"{run['final_reward']:.3f} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--work", type=Path, default=REPO / "runs" / "ablation")
    parser.add_argument("--tiny-dir", type=Path, default=REPO / ".areal" / "tiny")
    parser.add_argument("--reuse", action="store_true", help="read finished runs in --work instead of training")
    sub = parser.add_subparsers(dest="command", required=True)
    drift_parser = sub.add_parser("drift", help="measure the drift of each setting at a high η")
    drift_parser.add_argument("--eta", type=int, default=8)
    drift_parser.add_argument("--steps", type=int, default=10)
    drift_parser.add_argument("--lrs", type=lambda s: [float(x) for x in s.split(",")], default=[2e-4, 5e-4])
    drift_parser.add_argument("--mini-batches", type=lambda s: [int(x) for x in s.split(",")], default=[16, 4])
    run_parser = sub.add_parser("run", help="the ablation in the chosen regime")
    run_parser.add_argument("--lr", type=float, required=True)
    run_parser.add_argument("--mini-batch", type=int, required=True)
    run_parser.add_argument("--etas", type=lambda s: [int(x) for x in s.split(",")], default=[0, 2, 8])
    run_parser.add_argument("--objectives", type=lambda s: s.split(","), default=list(OBJECTIVES))
    run_parser.add_argument("--m2po-etas", type=lambda s: [int(x) for x in s.split(",")], default=[8])
    run_parser.add_argument("--seeds", type=int, default=3)
    run_parser.add_argument("--steps", type=int, default=20)
    run_parser.add_argument("--test-freq", type=int, default=10)
    run_parser.add_argument("--window", type=int, default=5, help="final steps of train reward averaged")
    run_parser.add_argument("--resume", action="store_true", help="keep the runs already in ablation.json")
    guarantee_parser = sub.add_parser("guarantee", help="staleness past η per placement, η and on_stale")
    guarantee_parser.add_argument("--placements", type=lambda s: s.split(","), default=["colocated", "separate"])
    guarantee_parser.add_argument("--etas", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4])
    guarantee_parser.add_argument("--modes", type=lambda s: s.split(","), default=["wait", "reissue"])
    guarantee_parser.add_argument("--steps", type=int, default=8)
    sub.add_parser("table", help="print the tables of docs/results/ablation.md from the JSON in --out")
    args = parser.parse_args(argv)
    if args.command == "table":
        print(markdown_tables(args.out))
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    global REUSE
    REUSE = args.reuse
    commands = {"drift": run_drift, "run": run_ablation, "guarantee": run_guarantee}
    return commands[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
