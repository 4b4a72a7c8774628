"""Read a run's ``metrics.jsonl`` (verl's file logger) into a summary and a reward picture."""

from __future__ import annotations

import json
from pathlib import Path
from statistics import mean

REWARD_KEY = "critic/score/mean"
VALIDATION_PREFIX = "val-core/"


def load_metrics(path: Path) -> list[tuple[int, dict[str, float]]]:
    """``(step, metrics)`` per logged line, in order."""
    rows = []
    for line in path.read_text().splitlines():
        if line.strip():
            record = json.loads(line)
            rows.append((int(record["step"]), record["data"]))
    return rows


def validation_series(rows: list[tuple[int, dict[str, float]]]) -> dict[str, list[tuple[int, float]]]:
    series: dict[str, list[tuple[int, float]]] = {}
    for step, data in rows:
        for key, value in data.items():
            if key.startswith(VALIDATION_PREFIX):
                series.setdefault(key[len(VALIDATION_PREFIX) :], []).append((step, float(value)))
    return series


def summarize_run(path: Path, window: int = 5) -> list[str]:
    """Lines comparing the first and last ``window`` steps' reward, and first vs last validation."""
    rows = load_metrics(path)
    rewards = [data[REWARD_KEY] for _, data in rows if REWARD_KEY in data]
    lines = []
    if rewards:
        head, tail = rewards[:window], rewards[-window:]
        lines.append(
            f"train reward (mean of {len(head)} steps): first {mean(head):.3f} -> last {mean(tail):.3f} "
            f"over {len(rewards)} steps"
        )
    for name, points in validation_series(rows).items():
        (first_step, first), (last_step, last) = points[0], points[-1]
        lines.append(f"validation {name}: {first:.3f} (step {first_step}) -> {last:.3f} (step {last_step})")
    return lines


def plot_run(path: Path, out: Path) -> Path:
    """Draw train reward per step and validation accuracy to ``out`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = load_metrics(path)
    steps = [step for step, data in rows if REWARD_KEY in data]
    rewards = [data[REWARD_KEY] for _, data in rows if REWARD_KEY in data]
    figure, axis = plt.subplots(figsize=(7, 4))
    axis.plot(steps, rewards, marker=".", label="train reward (mean per step)")
    for name, points in validation_series(rows).items():
        axis.plot([s for s, _ in points], [v for _, v in points], marker="o", label=f"validation {name}")
    axis.set_xlabel("training step")
    axis.set_ylabel("reward / accuracy")
    axis.set_ylim(0, 1)
    axis.grid(alpha=0.3)
    axis.legend(loc="lower right")
    axis.set_title(path.parent.name)
    figure.tight_layout()
    figure.savefig(out, dpi=110)
    plt.close(figure)
    return out
