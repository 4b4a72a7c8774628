"""Does the tiny model learn with LoRA under ``areal_async``, and how does it compare with full fine-tuning?

``python tools/lora_vs_full.py`` trains the main recipe (``recipes/grpo_cpu_async.yaml``: colocated, η = 1,
``areal_cpu``) for ``--steps`` steps per arm and seed, with greedy validation accuracy on the held-out problems
before training and every ``--test-freq`` steps, and the train reward of every step:

- ``full``: full fine-tuning at the recipe's learning rate (2e-4);
- ``lora``: a rank-8 adapter (``lora_alpha`` 16, verl's ``target_modules: all-linear``), adapter-only updates checked
  on every sync, at ``--lora-lr-factor`` times that rate (10 by default: LoRA trains far fewer weights, and the
  usual advice is a learning rate about ten times the full one; fixed before any run, not tuned on the result).

Writes ``docs/results/lora_vs_full.json`` and ``lora_vs_full.png`` (validation accuracy and train reward per arm:
seed mean with its min-max band). ``--table`` prints docs/results/lora.md's table from the JSON.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from ablation import REWARD_KEY, read_metrics, series, train, validation_accuracy
from repeats import spread

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "docs" / "results"
RECIPE = REPO / "recipes" / "grpo_cpu_async.yaml"
FULL_LR = 2e-4  # recipes/_cpu_grpo_tiny.yaml, actor.optim.lr
LORA = ["actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.lora_alpha=16"]


def arm_overrides(arm: str, lr_factor: float) -> list[str]:
    if arm == "full":
        return [f"actor_rollout_ref.actor.optim.lr={FULL_LR}"]
    return [*LORA, f"actor_rollout_ref.actor.optim.lr={FULL_LR * lr_factor:g}"]


def summarize(runs: dict[str, Any], window: int) -> dict[str, Any]:
    """Per arm over seeds: validation accuracy before and after, its gain, and the first/last ``window`` steps'
    train reward."""
    summary = {}
    for arm in sorted({run["arm"] for run in runs.values()}):
        members = [run for run in runs.values() if run["arm"] == arm]
        first = [run["validation"][0][1] for run in members if run["validation"]]
        last = [run["validation"][-1][1] for run in members if run["validation"]]
        early = [statistics.mean(v for _, v in run["reward"][:window]) for run in members if run["reward"]]
        late = [statistics.mean(v for _, v in run["reward"][-window:]) for run in members if run["reward"]]
        summary[arm] = {
            "seeds": len(members),
            "validation_before": spread(first, centre="mean", count=None),
            "validation_after": spread(last, centre="mean", count=None),
            "validation_gain": spread([b - a for a, b in zip(first, last, strict=True)], centre="mean", count=None),
            "reward_first_steps": spread(early, centre="mean", count=None),
            "reward_last_steps": spread(late, centre="mean", count=None),
            "seconds_per_step": spread([run["seconds_per_step"] for run in members], centre="mean", count=None),
        }
    return summary


def plot(report: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 2, figsize=(9.5, 3.8))
    colours = {"full": "#4c72b0", "lora": "#dd8452"}
    panels = ((axes[0], "validation", "greedy validation accuracy"), (axes[1], "reward", "train reward"))
    for axis, key, label in panels:
        for arm, colour in colours.items():
            members = [run for run in report["runs"].values() if run["arm"] == arm and run[key]]
            if not members:
                continue
            steps = [step for step, _ in members[0][key]]
            columns = list(zip(*[[value for _, value in run[key]] for run in members], strict=False))
            means = [statistics.mean(column) for column in columns]
            name = f"{arm}, lr {report['lr'][arm]:g} ({len(members)} seeds)"
            axis.plot(steps[: len(means)], means, color=colour, marker="o" if key == "validation" else None, label=name)
            axis.fill_between(
                steps[: len(means)], [min(c) for c in columns], [max(c) for c in columns], color=colour, alpha=0.2
            )
        axis.set_xlabel("training step")
        axis.set_ylabel(label)
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
    figure.suptitle("tiny Qwen2, main recipe (colocated, η = 1): LoRA rank 8 vs full fine-tuning; band: seed min-max")
    figure.tight_layout()
    figure.savefig(out, dpi=110)


def cell(value: dict[str, float] | None, digits: int = 3) -> str:
    if value is None or value["mean"] is None:
        return "-"
    return f"{value['mean']:.{digits}f} ({value['min']:.{digits}f} to {value['max']:.{digits}f})"


def markdown_table(report: dict[str, Any]) -> str:
    rows = [
        "| arm | lr | seeds | validation before | validation after | gain | train reward, first 3 steps | "
        "train reward, last 3 steps | s per step |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for arm, row in report["summary"].items():
        rows.append(
            f"| {arm} | {report['lr'][arm]:g} | {row['seeds']} | {cell(row['validation_before'])} | "
            f"{cell(row['validation_after'])} | {cell(row['validation_gain'])} | {cell(row['reward_first_steps'])} | "
            f"{cell(row['reward_last_steps'])} | {cell(row['seconds_per_step'], 1)} |"
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--work", type=Path, default=REPO / "runs" / "lora_vs_full")
    parser.add_argument("--tiny-dir", type=Path, default=REPO / ".areal" / "tiny")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--test-freq", type=int, default=8)
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--lora-lr-factor", type=float, default=10.0)
    parser.add_argument("--window", type=int, default=3, help="first and last steps of train reward averaged")
    parser.add_argument("--table", action="store_true", help="print the table from the JSON in --out")
    args = parser.parse_args(argv)
    path = args.out / "lora_vs_full.json"
    if args.table:
        print(markdown_table(json.loads(path.read_text())))
        return 0
    lrs = {"full": FULL_LR, "lora": FULL_LR * args.lora_lr_factor}
    report: dict[str, Any] = {"steps": args.steps, "test_freq": args.test_freq, "lr": lrs, "runs": {}}
    for seed in range(args.seeds):
        for arm in ("full", "lora"):
            name = f"{arm}-seed{seed}"
            overrides = [
                f"trainer.total_training_steps={args.steps}",
                "trainer.val_before_train=true",
                f"trainer.test_freq={args.test_freq}",
                f"data.seed={seed}",
                f"actor_rollout_ref.rollout.seed={seed}",
                *arm_overrides(arm, args.lora_lr_factor),
            ]
            rows = train(args.work / name, overrides, args.tiny_dir, recipe=RECIPE)
            steps = read_metrics(args.work / name / "areal_steps.jsonl")
            times = [b["time"] - a["time"] for a, b in itertools.pairwise(steps)]
            report["runs"][name] = {
                "arm": arm,
                "seed": seed,
                "validation": validation_accuracy(rows),
                "reward": series(rows, REWARD_KEY),
                "seconds_per_step": statistics.median(times) if times else None,
            }
            report["summary"] = summarize(report["runs"], args.window)
            path.write_text(json.dumps(report, indent=2) + "\n")
    plot(report, args.out / "lora_vs_full.png")
    print(markdown_table(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
