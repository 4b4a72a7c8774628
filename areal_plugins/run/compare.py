"""Where two runs first differ: the trajectories each step trained, then the step's learning metrics.

Compares the records of two run directories step by step (``areal_samples.jsonl``: which trajectories a step
trained, in order, with their requests and token digests; ``metrics.jsonl``: verl's loss, gradient norm and
learning rate) and reports the first difference with both values. What was trained comes before what was learned
from it: a step whose samples differ is reported by its samples, not by its loss. ``areal-plugins compare``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: Per trained trajectory, in this order: which prompt, which tokens, how they were generated, what they scored.
SAMPLE_FIELDS = (
    "prompt_digest",
    "response_digest",
    "response_tokens",
    "chunks",
    "head_version",
    "tail_version",
    "reward",
)
#: Per step, from verl's metrics, in this order: the setting first, then what the update computed from the batch.
METRIC_FIELDS = (
    "actor/lr",
    "critic/score/mean",
    "critic/advantages/mean",
    "actor/pg_loss",
    "actor/loss",
    "actor/entropy",
    "actor/grad_norm",
)


@dataclass(frozen=True)
class Divergence:
    step: int
    field: str
    first: Any
    second: Any
    trajectory: int | None = None  # position in the step's consumption order

    def __str__(self) -> str:
        where = f"step {self.step}" + (f", trajectory {self.trajectory}" if self.trajectory is not None else "")
        return f"{where}, {self.field}: {self.first!r} vs {self.second!r}"


@dataclass(frozen=True)
class Comparison:
    steps: int
    trajectories: int
    divergence: Divergence | None


def read_run(run_dir: Path) -> tuple[dict[int, list[dict[str, Any]]], dict[int, dict[str, Any]]]:
    """A run's trained trajectories by step (in consumption order) and its metrics by step."""
    samples_path, metrics_path = run_dir / "areal_samples.jsonl", run_dir / "metrics.jsonl"
    for path in (samples_path, metrics_path):
        if not path.is_file():
            raise FileNotFoundError(f"{path} is missing: pass run directories written by areal-plugins train")
    samples: dict[int, list[dict[str, Any]]] = {}
    for line in samples_path.read_text().splitlines():
        if line:
            sample = json.loads(line)
            samples.setdefault(int(sample["step"]), []).append(sample)
    if samples and "response_digest" not in next(iter(samples.values()))[0]:
        raise ValueError(f"{samples_path} has no token digests: the run predates the schedule record")
    metrics: dict[int, dict[str, Any]] = {}
    for line in metrics_path.read_text().splitlines():
        if line:
            data = json.loads(line)["data"]
            metrics[int(data["training/global_step"])] = data
    return samples, metrics


def same(first: Any, second: Any, rtol: float) -> bool:
    if isinstance(first, float) and isinstance(second, float) and rtol > 0:
        return math.isclose(first, second, rel_tol=rtol, abs_tol=0.0)
    return first == second


def compare_runs(first_dir: Path, second_dir: Path, rtol: float = 0.0) -> Comparison:
    """The first difference over the steps both runs trained (exact unless ``rtol``, which applies to floats)."""
    first_samples, first_metrics = read_run(first_dir)
    second_samples, second_metrics = read_run(second_dir)
    steps = sorted(set(first_metrics) & set(second_metrics))
    trajectories = 0
    for step in steps:
        ours, theirs = first_samples.get(step, []), second_samples.get(step, [])
        if len(ours) != len(theirs):
            return Comparison(steps.index(step), trajectories, Divergence(step, "trajectories", len(ours), len(theirs)))
        for position, (a, b) in enumerate(zip(ours, theirs, strict=True)):
            for name in SAMPLE_FIELDS:
                if not same(a.get(name), b.get(name), rtol):
                    divergence = Divergence(step, name, a.get(name), b.get(name), trajectory=position)
                    return Comparison(steps.index(step), trajectories, divergence)
            trajectories += 1
        for name in METRIC_FIELDS:
            ours_value, theirs_value = first_metrics[step].get(name), second_metrics[step].get(name)
            if not same(ours_value, theirs_value, rtol):
                return Comparison(steps.index(step), trajectories, Divergence(step, name, ours_value, theirs_value))
    return Comparison(len(steps), trajectories, None)
