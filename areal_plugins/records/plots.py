"""Pictures of a run directory: reward, staleness, and who was busy when (``areal-plugins plot``).

Reads what a run writes: verl's ``metrics.jsonl``, and for async runs our ``areal_steps.jsonl``,
``areal_samples.jsonl`` and ``timeline.jsonl`` (see ``areal_plugins.records.writer``).
"""

from __future__ import annotations

from collections import Counter
from itertools import pairwise
from pathlib import Path
from typing import Any

from areal_plugins.records.report import plot_run
from areal_plugins.records.writer import read_jsonl

#: Timeline colours: trainer computing / waiting for samples / loading weights; rollout generating.
COLOURS = {"train": "#4c72b0", "wait": "#dd8452", "update": "#c44e52", "generate": "#55a868"}


def plot_all(run_dir: Path) -> list[Path]:
    """Write every picture the run's files allow; return their paths."""
    written = []
    if (run_dir / "metrics.jsonl").exists():
        written.append(plot_run(run_dir / "metrics.jsonl", run_dir / "reward.png"))
    steps = read_jsonl(run_dir / "areal_steps.jsonl")
    samples = read_jsonl(run_dir / "areal_samples.jsonl")
    if steps and samples:
        written.append(plot_staleness(steps, samples, run_dir / "staleness.png"))
    timeline = read_jsonl(run_dir / "timeline.jsonl")
    if timeline:
        written.append(plot_timeline(timeline, run_dir / "timeline.png"))
    return written


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_staleness(steps: list[dict], samples: list[dict], out: Path) -> Path:
    """Staleness mean/max per step, and the histogram over every consumed trajectory."""
    plt = _pyplot()
    figure, (curve, histogram) = plt.subplots(1, 2, figsize=(11, 4))
    xs = [s["step"] for s in steps]
    curve.plot(xs, [s["areal/staleness_mean"] for s in steps], marker=".", label="mean")
    curve.plot(xs, [s["areal/staleness_max"] for s in steps], marker="^", label="max")
    if "areal/multi_version_fraction" in steps[0]:
        twin = curve.twinx()
        twin.plot(
            xs, [s["areal/multi_version_fraction"] for s in steps], color="grey", ls=":", label="spans 2+ versions"
        )
        twin.set_ylabel("fraction of trajectories spanning 2+ versions", color="grey")
        twin.set_ylim(0, 1)
    curve.set_xlabel("training step")
    curve.set_ylabel("staleness (versions)")
    curve.grid(alpha=0.3)
    curve.legend(loc="upper left")
    curve.set_title("staleness of consumed samples")
    counts = Counter(s["trainer_version"] - s["head_version"] for s in samples)
    values = sorted(counts)
    histogram.bar(values, [counts[v] for v in values], color="#4c72b0")
    histogram.set_xticks(values)
    histogram.set_xlabel("staleness = trainer version - head version")
    histogram.set_ylabel("trajectories")
    histogram.set_title(f"{len(samples)} consumed trajectories")
    figure.tight_layout()
    figure.savefig(out, dpi=110)
    plt.close(figure)
    return out


def busy_intervals(rollout_samples: list[dict]) -> list[tuple[float, float]]:
    """Intervals between consecutive rollout samples during which requests were in flight."""
    intervals = []
    for before, after in pairwise(rollout_samples):
        if before["in_flight"] > 0 or after["busy_s"] > before["busy_s"]:
            intervals.append((before["time"], after["time"]))
    return intervals


def plot_timeline(events: list[dict], out: Path) -> Path:
    """Two lanes: trainer (computing / waiting / loading weights) and rollout (generating)."""
    plt = _pyplot()
    spans = [e for e in events if "start" in e]
    rollout = sorted((e for e in events if e.get("who") == "rollout" and "time" in e), key=lambda e: e["time"])
    t0 = min([e["start"] for e in spans] + [e["time"] for e in rollout])
    figure, axis = plt.subplots(figsize=(12, 2.8))
    for span in spans:
        if span["who"] != "trainer":
            continue
        lane_what = "train" if span["what"] == "step" else span["what"]
        axis.barh(
            1,
            span["end"] - span["start"],
            left=span["start"] - t0,
            height=0.6 if lane_what == "train" else 0.8,
            color=COLOURS.get(lane_what, "grey"),
            alpha=0.5 if lane_what == "train" else 0.95,
        )
    for start, end in busy_intervals(rollout):
        axis.barh(0, end - start, left=start - t0, height=0.6, color=COLOURS["generate"])
    axis.set_yticks([0, 1], ["rollout", "trainer"])
    axis.set_xlabel("seconds since training started")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in COLOURS.values()]
    axis.legend(
        handles,
        ["training step", "waiting for samples", "weight update", "generating"],
        ncol=4,
        loc="upper right",
        fontsize=8,
    )
    axis.set_ylim(-0.6, 1.9)
    axis.set_title("who was busy: trainer vs rollout")
    figure.tight_layout()
    figure.savefig(out, dpi=110)
    plt.close(figure)
    return out
