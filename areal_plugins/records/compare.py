"""Where two runs first differ: the trajectories each step trained, then the step's learning metrics.

Compares the records of two run directories step by step and reports the first difference with both values. Per
step, from ``areal_samples.jsonl``: which trajectories were trained (prompt and response digests, as multisets),
then in which order, then how each was generated (requests, versions) and scored; then, from verl's
``metrics.jsonl``, the learning rate, losses and gradient norm. What was trained comes before what was learned
from it: a step whose samples differ is reported by its samples, not by its loss. ``areal-plugins compare``.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from areal_plugins.records.report import load_metrics

#: Per trained trajectory, once both runs trained the same tokens in the same order: how they were generated and
#: what they scored.
SAMPLE_FIELDS = (
    "chunks",
    "logprobs_digest",
    "response_tokens",
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


def read_samples(path: Path) -> dict[int, list[dict[str, Any]]]:
    """Trained trajectories by step, in consumption order. A step trained again after a resume (by another trainer
    process: another ``attempt``) is taken from its last attempt."""
    samples: dict[int, list[dict[str, Any]]] = {}
    attempts: dict[int, Any] = {}
    for line in path.read_text().splitlines():
        if not line:
            continue
        sample = json.loads(line)
        step = int(sample["step"])
        if attempts.setdefault(step, sample.get("attempt")) != sample.get("attempt"):
            samples[step], attempts[step] = [], sample.get("attempt")  # this attempt replaces the earlier one
        samples.setdefault(step, []).append(sample)
    if samples and "response_digest" not in next(iter(samples.values()))[0]:
        raise ValueError(f"{path} has no token digests: the run predates the schedule record")
    return samples


def read_metrics(run_dir: Path) -> dict[int, dict[str, Any]]:
    """verl's training metrics by step, across resumes (``areal-plugins train`` keeps the metrics of an earlier
    attempt as ``metrics.before-*.jsonl``; later lines win). Validation-only lines carry no training step."""
    metrics: dict[int, dict[str, Any]] = {}
    for path in [*sorted(run_dir.glob("metrics.before-*.jsonl")), run_dir / "metrics.jsonl"]:
        for _, data in load_metrics(path) if path.is_file() else []:
            if "training/global_step" in data:
                metrics[int(data["training/global_step"])] = data
    return metrics


def read_run(run_dir: Path) -> tuple[dict[int, list[dict[str, Any]]], dict[int, dict[str, Any]]]:
    """A run's trained trajectories by step (in consumption order) and its training metrics by step."""
    samples_path = run_dir / "areal_samples.jsonl"
    if not samples_path.is_file():
        raise FileNotFoundError(
            f"{samples_path} is missing: pass run directories written by areal-plugins train (areal.enable: true)"
        )
    return read_samples(samples_path), read_metrics(run_dir)


def same(first: Any, second: Any, rtol: float) -> bool:
    if isinstance(first, float) and isinstance(second, float):
        if math.isnan(first) and math.isnan(second):
            return True
        return math.isclose(first, second, rel_tol=rtol, abs_tol=0.0) if rtol > 0 else first == second
    return first == second


def tokens_of(sample: dict[str, Any]) -> tuple[str, str]:
    return sample["prompt_digest"], sample["response_digest"]


def step_divergence(step: int, ours: list[dict], theirs: list[dict], rtol: float) -> Divergence | None:
    """What differs between two steps' trained trajectories: which were trained, then in which order, then how
    each was generated and scored."""
    ours_tokens, theirs_tokens = Counter(map(tokens_of, ours)), Counter(map(tokens_of, theirs))
    if ours_tokens != theirs_tokens:
        only_ours = next((t for t in map(tokens_of, ours) if ours_tokens[t] > theirs_tokens[t]), None)
        only_theirs = next((t for t in map(tokens_of, theirs) if theirs_tokens[t] > ours_tokens[t]), None)
        return Divergence(step, "trained (prompt, response) digests", only_ours, only_theirs)
    for position, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        if tokens_of(a) != tokens_of(b):  # the same trajectories, consumed in another order
            return Divergence(step, "consumption order", tokens_of(a), tokens_of(b), trajectory=position)
    for position, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        for name in SAMPLE_FIELDS:
            if name not in a or name not in b:  # a record that predates the field: nothing to compare
                continue
            if not same(a.get(name), b.get(name), rtol):
                return Divergence(step, name, a.get(name), b.get(name), trajectory=position)
    return None


def compare_runs(first_dir: Path, second_dir: Path, rtol: float = 0.0) -> Comparison:
    """The first difference over the steps both runs trained (exact unless ``rtol``, which applies to floats).

    Steps are those both runs' ``areal_samples.jsonl`` hold; a step's metrics are compared where both runs
    logged them."""
    first_samples, first_metrics = read_run(first_dir)
    second_samples, second_metrics = read_run(second_dir)
    steps = sorted(set(first_samples) & set(second_samples))
    trajectories = 0
    for matched, step in enumerate(steps):
        divergence = step_divergence(step, first_samples[step], second_samples[step], rtol)
        if divergence is None and step in first_metrics and step in second_metrics:
            for name in METRIC_FIELDS:
                ours, theirs = first_metrics[step].get(name), second_metrics[step].get(name)
                if not same(ours, theirs, rtol):
                    divergence = Divergence(step, name, ours, theirs)
                    break
        if divergence is not None:
            return Comparison(matched, trajectories, divergence)
        trajectories += len(first_samples[step])
    return Comparison(len(steps), trajectories, None)
