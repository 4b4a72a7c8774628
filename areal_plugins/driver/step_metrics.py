"""Per-step metrics of the async trainer (namespaced ``areal/``), and the records written from them."""

from __future__ import annotations

import logging
import uuid
from collections import Counter
from typing import Any

from areal_plugins.core.buffer import BufferedGroup
from areal_plugins.hooks.contracts import staleness_controller_of

logger = logging.getLogger(__name__)

#: This trainer process's attempt at the run: a step trained again after a resume is told from its earlier attempt.
ATTEMPT = uuid.uuid4().hex[:8]


def consumed_metrics(groups: list[BufferedGroup], trainer_version: int) -> dict[str, float]:
    """Staleness and version statistics of the trajectories a step consumed.

    Staleness of a trajectory is ``trainer_version - head_version`` (docs/design.md, Versions), where
    ``trainer_version`` is the version of the weights this step starts from.
    """
    infos = [info for group in groups for info in group.info]
    if not infos:
        return {}
    staleness = [trainer_version - info["head_version"] for info in infos]
    metrics: dict[str, float] = {
        "areal/staleness_mean": sum(staleness) / len(staleness),
        "areal/staleness_max": float(max(staleness)),
        "areal/head_version_min": float(min(info["head_version"] for info in infos)),
        "areal/tail_version_max": float(max(info["tail_version"] for info in infos)),
        "areal/trainer_version": float(trainer_version),
        "areal/interrupted_fraction": sum(info["num_interrupts"] > 0 for info in infos) / len(infos),
        "areal/multi_version_fraction": sum(info["tail_version"] > info["head_version"] for info in infos) / len(infos),
        "areal/consumed_trajectories": float(len(infos)),
        "areal/consumed_response_tokens": float(sum(info["response_tokens"] for info in infos)),
    }
    for value, count in sorted(Counter(staleness).items()):
        metrics[f"areal/staleness_count/{value}"] = float(count)
    metrics.update(reward_service_metrics([info.get("reward_report") or {} for info in infos]))
    metrics.update(episode_metrics(infos))
    return metrics


def episode_metrics(infos: list[dict[str, Any]]) -> dict[str, float]:
    """Turns, tool calls and where weight updates met the step's episodes (docs/multi_turn.md)."""
    infos = [info for info in infos if "turns" in info]
    if not infos:
        return {}
    calls = sum(info["tool_calls"] for info in infos)
    return {
        "areal/turns_mean": sum(info["turns"] for info in infos) / len(infos),
        "areal/turns_max": float(max(info["turns"] for info in infos)),
        "areal/tool_calls": float(calls),
        "areal/tool_failures": float(sum(info["tool_failures"] for info in infos)),
        "areal/tool_latency_s_mean": sum(info["tool_seconds"] for info in infos) / calls if calls else 0.0,
        # A weight update met the episode inside a turn (the request was interrupted and resumed) ...
        "areal/episodes_interrupted_within_turn": float(sum(info["num_interrupts"] > 0 for info in infos)),
        # ... or between two turns (during a tool call, or while the next turn waited for the engine).
        "areal/episodes_updated_between_turns": float(sum(info["updates_between_turns"] > 0 for info in infos)),
    }


def reward_service_metrics(reports: list[dict[str, float]]) -> dict[str, float]:
    """Latency and failures of the reward service over the step's trajectories (empty without it)."""
    reports = [report for report in reports if "areal_reward_latency_s" in report]
    if not reports:
        return {}
    latencies = [report["areal_reward_latency_s"] for report in reports]
    return {
        "areal/reward_latency_s_mean": sum(latencies) / len(latencies),
        "areal/reward_latency_s_max": max(latencies),
        "areal/reward_failed": sum(report.get("areal_reward_failed", 0.0) for report in reports),
        "areal/reward_timeouts": sum(report.get("areal_reward_timeouts", 0.0) for report in reports),
        "areal/reward_crashes": sum(report.get("areal_reward_crashes", 0.0) for report in reports),
    }


def rollout_rates(before: dict[str, Any] | None, after: dict[str, Any] | None, wall_s: float) -> dict[str, float]:
    """Engine-side rates between two ``get_stats`` snapshots summed over replicas."""
    if not before or not after or wall_s <= 0:
        return {}
    replicas = max(1, int(after.get("replicas", 1)))
    busy = after["busy_s"] - before["busy_s"]
    tokens = after["generated_tokens"] - before["generated_tokens"]
    return {
        "areal/rollout_idle_ratio": max(0.0, 1.0 - busy / (wall_s * replicas)),
        "areal/gen_tokens_per_s": tokens / wall_s,
        "areal/engine_restarts": float(after.get("restarts", 0)),  # since the run started
    }


#: The rollout manager's counters since the start, logged every step as ``areal/<name>``.
MANAGER_COUNTERS = (
    "rejected_trajectories",
    "failed_groups",
    "reissued_groups",
    "reissued_stale_groups",
    "dropped_stale_groups",
)


def admission_metrics(manager: Any, buffer: Any) -> dict[str, float]:
    """Where admission stands after a step took its batch (the contracts of hooks/contracts.py)."""
    controller = staleness_controller_of(manager)
    metrics = {
        "areal/buffer_size": float(len(buffer)),
        "areal/running": float(controller.running),
        "areal/accepted": float(controller.accepted),
        "areal/rejected": float(controller.rejected),
        "areal/over_stale_trained": float(buffer.over_stale_kept),
    }
    if hasattr(manager, "listings"):  # our AdmissionLoop: its polls since the start, and how many listed everything
        metrics["areal/admission_polls"] = float(manager.polls)
        metrics["areal/partition_listings"] = float(manager.listings)
        metrics["areal/settled_from_reports"] = float(manager.settled_from_reports)  # rows not read
        metrics["areal/settled_from_rows"] = float(manager.settled_from_rows)
    return metrics | {f"areal/{name}": float(getattr(manager, name)) for name in MANAGER_COUNTERS}


def run_state_metrics(engine_stats: Any, replicas: int, replacer: Any) -> dict[str, float]:
    """The rollout side's state at the step line: statistics calls failed and late, replicas serving, replaced
    (after a death) and added (a node joined)."""
    return {
        "areal/rollout_stats_errors": float(engine_stats.errors),
        "areal/rollout_stats_timeouts": float(engine_stats.timeouts),
        "areal/rollout_replicas": float(replicas),
        "areal/rollout_replicas_replaced": float(replacer.replaced),
        "areal/rollout_replicas_added": float(replacer.grown),
    }


def resume_metrics(counts: dict[str, dict[str, int]] | None) -> dict[str, float]:
    """Tokens the resumed checkpoint kept and, of them, continued (none for a run that did not resume)."""
    if counts is None:
        return {}
    return {
        "areal/resume_saved_tokens": float(counts["saved"]["tokens"]),
        "areal/resume_continued_tokens": float(counts["continued"]["tokens"]),
    }


def write_step_line(
    recorder: Any, metrics: dict, step: int, step_s: float, wait_s: float, started: float, now: float
) -> None:
    """Our record of step ``step`` (``areal_steps.jsonl``) and the trainer's span on the timeline; ``step_s``:
    the step's time, ``wait_s``: of it, the time spent waiting for samples."""
    if step_s > 0:
        metrics["areal/trainer_idle_ratio"] = min(1.0, wait_s / step_s)
        metrics["areal/train_tokens_per_s"] = metrics.get("areal/consumed_response_tokens", 0.0) / step_s
    recorder.write("timeline.jsonl", {"who": "trainer", "what": "step", "start": started, "end": now, "step": step})
    recorder.write(
        "areal_steps.jsonl", {"step": step, "time": now} | {k: v for k, v in metrics.items() if k.startswith("areal/")}
    )


def write_accounting(recorder: Any, manager: Any, buffer: Any, submitted: int, counts: Any, version: int) -> None:
    """Where every submitted rollout group ended up (``areal_accounting.jsonl``), at the end of a run."""
    record = {
        "submitted": submitted,
        **staleness_controller_of(manager).state_dict(),
        "consumed": counts.consumed_groups,
        "buffered": len(buffer),
        **{name: getattr(manager, name) for name in MANAGER_COUNTERS},
        "version": version,
    }
    recorder.write("areal_accounting.jsonl", record)
    logger.info("areal_async accounting: %s", record)


def write_samples(recorder: Any, groups: list[BufferedGroup], step: int, trainer_version: int) -> None:
    """One ``areal_samples.jsonl`` line per trajectory step ``step`` trains, with its versions."""
    for group in groups:
        for key, info in zip(group.keys, group.info, strict=True):
            recorder.write(
                "areal_samples.jsonl",
                {"step": step, "attempt": ATTEMPT, "trainer_version": trainer_version, "group": group.group_id}
                | {"key": key}
                | info,
            )
