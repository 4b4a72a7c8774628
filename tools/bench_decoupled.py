"""Stale samples with and without the decoupled PPO objective: ``python tools/bench_decoupled.py``.

Trains the CPU task asynchronously at η = 4 (``grpo_cpu_async_separate``: generation runs ahead, so
most consumed samples are 3-4 versions old) once with ``areal.loss.decoupled=true`` and once with
``false`` (standard PPO against the behaviour policy, what a naive async system does), for several
seeds with the same seeds on both sides. Writes ``decoupled.json`` (per-step reward per run, the
final-window mean per arm with its spread) and ``decoupled.png`` (reward curves side by side).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ARMS = {"decoupled": "areal.loss.decoupled=true", "standard PPO (behaviour = old)": "areal.loss.decoupled=false"}


def train(arm: str, override: str, seed: int, args: argparse.Namespace) -> list[float]:
    run_dir = args.out / f"{'decoupled' if 'true' in override else 'standard'}-seed{seed}"
    command = [
        sys.executable,
        "-m",
        "areal_plugins.cli",
        "train",
        str(REPO / "recipes" / "grpo_cpu_async_separate.yaml"),
        f"trainer.total_training_steps={args.steps}",
        "trainer.val_before_train=false",
        "trainer.test_freq=-1",
        f"areal.max_staleness={args.eta}",
        override,
        f"data.seed={seed}",
        f"actor_rollout_ref.rollout.seed={seed}",
        "--run-dir",
        str(run_dir),
        "--tiny-dir",
        str(args.tiny_dir),
    ]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{arm} seed {seed} failed; see {run_dir / 'train.log'}")
    rows = [json.loads(line)["data"] for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [row["critic/score/mean"] for row in rows if "critic/score/mean" in row]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--eta", type=int, default=4)
    parser.add_argument("--window", type=int, default=10, help="final steps averaged for the summary")
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "bench_decoupled")
    parser.add_argument("--tiny-dir", type=Path, default=REPO / ".areal" / "tiny")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    curves: dict[str, list[list[float]]] = {arm: [] for arm in ARMS}
    for seed in range(args.seeds):
        for arm, override in ARMS.items():
            curves[arm].append(train(arm, override, seed, args))
            print(f"{arm} seed {seed}: final reward {statistics.mean(curves[arm][-1][-args.window :]):.3f}", flush=True)
    summary = {}
    for arm, runs in curves.items():
        finals = [statistics.mean(run[-args.window :]) for run in runs]
        summary[arm] = {
            "final_mean": statistics.mean(finals),
            "min": min(finals),
            "max": max(finals),
            "per_seed": finals,
        }
    (args.out / "decoupled.json").write_text(
        json.dumps({"eta": args.eta, "steps": args.steps, "summary": summary, "curves": curves}, indent=2)
    )
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(ARMS), figsize=(11, 4), sharey=True)
    for axis, (arm, runs) in zip(axes, curves.items(), strict=True):
        for seed, run in enumerate(runs):
            axis.plot(range(1, len(run) + 1), run, alpha=0.8, label=f"seed {seed}")
        axis.set_title(f"{arm}, eta={args.eta}: last-{args.window} mean {summary[arm]['final_mean']:.3f}")
        axis.set_xlabel("training step")
        axis.grid(alpha=0.3)
    axes[0].set_ylabel("train reward (mean per step)")
    axes[0].legend()
    figure.tight_layout()
    figure.savefig(args.out / "decoupled.png", dpi=110)
    for arm, figures in summary.items():
        print(f"{arm}: final reward {figures['final_mean']:.3f} (seeds {figures['min']:.3f}..{figures['max']:.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
