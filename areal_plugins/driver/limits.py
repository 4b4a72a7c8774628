"""Every time limit, timeout and budget a run uses, with its value for the recipe and where it comes from.

One pure function, :func:`run_limits`, builds the list; ``areal-plugins check`` prints it for a recipe and the
async trainer logs it at startup (with what it measured by then), so the two cannot disagree. Each entry's source is
one of: a recipe key, measured by the run, derived from named keys or measurements, or a constant with the reason it
needs no sizing. ``tests/unit/test_limits.py`` reads every module-level timeout constant of the package and fails on
one that is neither listed here (an entry's ``constants``) nor in :data:`NOT_LIMITS` with a reason, so a new limit
cannot be added silently.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import areal_plugins.actors.settled_groups as settled_groups
import areal_plugins.driver.engine_stats as engine_stats
import areal_plugins.driver.replica_pool as replica_pool
import areal_plugins.driver.replica_replacement as replica_replacement
import areal_plugins.driver.watchdog as watchdog
import areal_plugins.records.control_files as control_files
import areal_plugins.rewards.service as reward_service
import areal_plugins.rewards.sizing as sizing
from areal_plugins.config.settings import areal_settings

if TYPE_CHECKING:
    from areal_plugins.config.settings import ArealConfig

#: Where a limit's value comes from.
RECIPE, MEASURED, DERIVED, CONSTANT = "recipe key", "measured", "derived", "constant"

#: Module-level constants the test's grep finds that are no limit of a run, each with why (``module.NAME``).
NOT_LIMITS: dict[str, str] = {
    "areal_plugins.actors.settled_groups.LOOKUP_AGAIN_S": "how often a worker looks for the inbox, not how long",
    "areal_plugins.actors.progress_board.REPORT_INTERVAL_S": "how often a worker reports progress, not how long",
    "areal_plugins.actors.progress_board.LOOKUP_INTERVAL_S": "how often a worker looks for the board, not how long",
    "areal_plugins.records.sink.LOOKUP_INTERVAL_S": "how often a writer looks for the record sink, not how long",
    "areal_plugins.driver.watchdog.CHECK_INTERVAL_S": "how often the wait's watchdog looks, not how long",
    "areal_plugins.driver.async_trainer.WAIT_CHECK_S": "how often the batch wait runs its checks, not how long",
    "areal_plugins.driver.engine_stats.MONITOR_S": "how often the timeline samples the engines, not how long",
    "areal_plugins.driver.actor_liveness.CHECK_INTERVAL_S": "how often liveness asks Ray, not how long",
    "areal_plugins.driver.replica_replacement.WAIT_FOR_DEVICES_S": "how often a start looks for free devices; "
    "how long it may wait is the replica start limit",
    "areal_plugins.agent_loop.episode_workers.CHECK_S": "how often an episode worker looks at its tasks",
    "areal_plugins.replay.driver_side.BARRIER_POLL_S": "how often the replay's barrier looks, not how long",
    "areal_plugins.cli.cluster_env.PROBE_TIMEOUT_S": "check's own probe of a declared cluster, before any run",
    "areal_plugins.cli.restarts.RESTART_BACKOFF_S": "a pause between two attempts of --max-restarts, no limit",
    "areal_plugins.cli.restarts.MAX_BACKOFF_S": "the longest pause between two attempts of --max-restarts, no limit",
}


@dataclass(frozen=True)
class Limit:
    """One limit of a run.

    ``value_s``: seconds for this recipe, None where there is none yet (measured later) or none at all;
    ``kind``: :data:`RECIPE`, :data:`MEASURED`, :data:`DERIVED` or :data:`CONSTANT`; ``source``: the key, the
    measurement or the formula, or for a constant why it needs no sizing; ``constants``: the module-level
    constants (``module.NAME``) it reads.
    """

    name: str
    value_s: float | None
    kind: str
    source: str
    constants: tuple[str, ...] = field(default=(), compare=False)


def _name(module: Any, constant: str) -> str:
    return f"{module.__name__}.{constant}"


def _select(config: Any, path: str, default: Any) -> Any:
    from omegaconf import OmegaConf

    if OmegaConf.is_config(config):
        value = OmegaConf.select(config, path, default=default)
        return default if value is None else value
    node: Any = config
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            return default
        node = node[part]
    return default if node is None else node


def _seconds(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.0f} s" if value >= 10 else f"{value:g} s"


def answers_per_step(config: Any) -> int:
    """``data.train_batch_size x actor_rollout_ref.rollout.n``: the answers one step scores."""
    return int(_select(config, "data.train_batch_size", 1)) * int(_select(config, "actor_rollout_ref.rollout.n", 1))


def reward_workers(config: Any) -> int:
    """verl's reward workers, ``reward.num_workers`` (verl 0.9.1's default: 8)."""
    return int(_select(config, "reward.num_workers", 8))


#: How the reward workers cap the count (rewards/sizing.capped_by_cores), said after the formula.
CORE_CAP = "; each reward worker caps it at floor(its node's cores x cpu_share / ceil(R / N)) when Ray's C is more"


def scorers(config: Any, cpu_nodes: int | None, cpus_per_node: int | None) -> tuple[int | None, str, str]:
    """The scoring processes per verl reward worker: ``(count or None, kind, source)``; None: sized at startup, from
    the nodes' CPUs (``cpus_per_node`` not known here)."""
    areal = areal_settings(config)
    configured = areal.reward.num_workers
    if configured is not None:
        return configured, RECIPE, "areal.reward.num_workers"
    answers, workers = answers_per_step(config), reward_workers(config)
    formula = (
        f"min(ceil(A / R), floor(C x {areal.reward.cpu_share:g} / ceil(R / N)), min(32, C + 4)) with A = {answers} "
        f"answers a step (data.train_batch_size x rollout.n), R = {workers} (reward.num_workers), "
        "areal.reward.cpu_share"
    )
    if cpu_nodes is None or cpus_per_node is None:
        return None, DERIVED, formula + "; N nodes with C CPUs each, read from Ray at startup"
    count = sizing.scorer_processes(answers, workers, cpu_nodes, cpus_per_node, areal.reward.cpu_share)
    return count, DERIVED, formula + f", N = {cpu_nodes} nodes, C = {cpus_per_node} CPUs" + CORE_CAP


def run_limits(
    config: Any,
    *,
    replica_start_s: float | None = None,
    longest_phase_s: float | None = None,
    checkpoint_s: float | None = None,
) -> list[Limit]:
    """Every limit the run of ``config`` (a composed recipe) uses, in the order a step meets them.

    ``replica_start_s``, ``longest_phase_s``, ``checkpoint_s``: what the run measured so far (None: not yet; the
    entry then shows what stands in until it is).
    """
    areal = areal_settings(config)
    return [
        *_stall_limits(areal),
        *_stop_limits(config, areal, longest_phase_s, checkpoint_s),
        *_reward_limits(config, areal),
        *_rollout_limits(config, areal, replica_start_s),
        Limit(
            "an episode outside the engine at a time (tools, environment)",
            areal.episodes.environment_timeout_s,
            RECIPE,
            "areal.episodes.environment_timeout_s (multi-turn agent loops)",
        ),
    ]


def _stall_limits(areal: ArealConfig) -> list[Limit]:
    """The watchdog's: the batch wait, the stall guard and its stop, and a replay's stuck limit."""
    watchdog_s = areal.watchdog_s
    limits: list[Limit] = []
    add = limits.append

    add(
        Limit(
            "batch wait with no rollout progress (the watchdog)",
            watchdog_s,
            RECIPE,
            "areal.watchdog_s; no group settled and no token generated for it while the trainer waits",
        )
    )
    add(
        Limit(
            "trainer computing with nothing moving (the stall guard)",
            watchdog.stall_limit(watchdog_s),
            DERIVED,
            f"areal.watchdog_s less {watchdog.STOP_MARGIN_S:g} s to stop within it (at least half of it); judged by "
            "progress (micro-batches started, tokens generated, phases ended), so a slow step that moves never stops",
            (_name(watchdog, "STOP_MARGIN_S"),),
        )
    )
    add(
        Limit(
            "stall guard's stop: the trainer's thread ends before the process exits",
            watchdog.INTERRUPT_GRACE_S,
            CONSTANT,
            "a thread back in Python ends at once; one stuck in a native call never does, whatever the wait",
            (_name(watchdog, "INTERRUPT_GRACE_S"),),
        )
    )
    if areal.replay.run_dir:
        add(
            Limit(
                "replay: recorded requests not generated (the replay's stuck limit)",
                watchdog_s,
                RECIPE,
                "areal.watchdog_s, with no recorded request of the batch generated meanwhile",
            )
        )
    return limits


def _stop_limits(
    config: Any, areal: ArealConfig, longest_phase_s: float | None, checkpoint_s: float | None
) -> list[Limit]:
    """Stopping a run: Ctrl-C's wait for the checkpointed stop, SIGTERM's grace, the cluster's cleanup."""
    limits: list[Limit] = []
    add = limits.append
    checkpoints = int(_select(config, "trainer.save_freq", -1)) > 0 and areal.mode == "async"
    slack = control_files.STOP_WAIT_SLACK
    if checkpoints:
        phase = longest_phase_s if longest_phase_s is not None else areal.watchdog_s
        saving = checkpoint_s if checkpoint_s is not None else areal.watchdog_s
        measured = longest_phase_s is not None and checkpoint_s is not None
        unmeasured = [
            name for name, value in (("longest phase", longest_phase_s), ("checkpoint", checkpoint_s)) if value is None
        ]
        add(
            Limit(
                "Ctrl-C: wait for the checkpointed stop before SIGTERM",
                (phase + saving) * (1 + slack),
                MEASURED if measured else DERIVED,
                f"(longest phase + checkpoint, as measured) x {1 + slack:g}"
                + (f"; areal.watchdog_s for the {' and the '.join(unmeasured)} until measured" if unmeasured else ""),
                (_name(control_files, "STOP_WAIT_SLACK"),),
            )
        )
    else:
        add(
            Limit(
                "Ctrl-C: wait for the checkpointed stop before SIGTERM",
                0.0,
                DERIVED,
                "none: SIGTERM at once (trainer.save_freq <= 0 or areal.mode: sync, nothing to checkpoint)",
            )
        )
    add(
        Limit(
            "SIGTERM to SIGKILL",
            control_files.SIGTERM_GRACE_S,
            CONSTANT,
            "verl's own teardown once nothing is left to save (the checkpoint was waited for before SIGTERM)",
            (_name(control_files, "SIGTERM_GRACE_S"),),
        )
    )
    add(
        Limit(
            "ending the run's leftovers on every node",
            control_files.CLUSTER_CLEANUP_S,
            CONSTANT,
            "one Ray task per node: a worker's start and a process scan, whatever the model",
            (_name(control_files, "CLUSTER_CLEANUP_S"),),
        )
    )
    add(
        Limit(
            "every node reading the checkpoint folder's marker before a run that restarts itself",
            control_files.SHARED_FOLDER_PROBE_S,
            CONSTANT,
            "one Ray task per node: a worker's start and one small file read, whatever the model",
            (_name(control_files, "SHARED_FOLDER_PROBE_S"),),
        )
    )
    return limits


def _reward_limits(config: Any, areal: ArealConfig) -> list[Limit]:
    """The reward service's: one scoring attempt and a scoring process's start (none without the service)."""
    limits: list[Limit] = []
    add = limits.append
    reward = areal.reward
    max_tokens = int(_select(config, "data.max_response_length", 0))
    max_chars = max_tokens * sizing.CHARS_PER_TOKEN
    at_max = sizing.reward_limit_s(reward.timeout_s, reward.timeout_chars, max_chars)
    if reward.service:
        add(
            Limit(
                "one reward (a scoring attempt)",
                at_max,
                DERIVED,
                f"areal.reward.timeout_s = {reward.timeout_s:g} s up to areal.reward.timeout_chars = "
                f"{reward.timeout_chars} chars, x chars / {reward.timeout_chars} past it: {_seconds(at_max)} at "
                f"data.max_response_length = {max_tokens} tokens ~ {max_chars} chars "
                f"({sizing.CHARS_PER_TOKEN} chars a token); {reward.retries} retries (areal.reward.retries)",
            )
        )
        add(
            Limit(
                "a new scoring process to start",
                reward_service.STARTUP_S,
                CONSTANT,
                "spawning Python and importing the reward's module, not the model's size; not part of a reward's limit",
                (_name(reward_service, "STARTUP_S"),),
            )
        )
    return limits


def _rollout_limits(config: Any, areal: ArealConfig, replica_start_s: float | None) -> list[Limit]:
    """The rollout side's: engine statistics, a server's probe, the inbox's drain, a replica's start and end (under
    ``separate``), an ``areal_gloo`` broadcast."""
    limits: list[Limit] = []
    add = limits.append
    add(
        Limit(
            "an engine statistics call",
            areal.watchdog_s,
            MEASURED,
            f"areal.watchdog_s until one is measured, then {engine_stats.SLOW_FACTOR:g} x the slowest answered "
            f"(at least {engine_stats.MIN_LIMIT_S:g} s, at most areal.watchdog_s); a late one is counted, not fatal",
            (_name(engine_stats, "SLOW_FACTOR"), _name(engine_stats, "MIN_LIMIT_S")),
        )
    )
    add(
        Limit(
            "a living rollout server's answer to the probe",
            replica_pool.PROBE_TIMEOUT_S,
            CONSTANT,
            "its control slots are kept free of requests, so the answer waits for no generation",
            (_name(replica_pool, "PROBE_TIMEOUT_S"),),
        )
    )
    add(
        Limit(
            "the settled-groups inbox's drain",
            settled_groups.DRAIN_TIMEOUT_S,
            CONSTANT,
            "one Ray call returning a list that grows with the groups settled since the last poll (a poll's worth); "
            "an inbox on a lost node stops the admission loop instead of hanging it",
            (_name(settled_groups, "DRAIN_TIMEOUT_S"),),
        )
    )
    if areal.placement == "separate":
        factor = replica_replacement.START_TIMEOUT_FACTOR
        if areal.replica_start_timeout_s is not None:
            start = Limit(
                "a rollout replica started mid-run (replacement, growth)",
                float(areal.replica_start_timeout_s),
                RECIPE,
                "areal.replica_start_timeout_s",
                (_name(replica_replacement, "START_TIMEOUT_FACTOR"),),
            )
        else:
            start = Limit(
                "a rollout replica started mid-run (replacement, growth)",
                None if replica_start_s is None else factor * replica_start_s,
                MEASURED,
                f"{factor:g} x the measured start of the run's replicas"
                + (f" ({replica_start_s:.0f} s)" if replica_start_s is not None else " (measured at startup)"),
                (_name(replica_replacement, "START_TIMEOUT_FACTOR"),),
            )
        add(start)
        add(
            Limit(
                "a dead replica's leftover processes to end",
                replica_replacement.END_LEFTOVERS_TIMEOUT_S,
                CONSTANT,
                "signals to processes on its nodes and their exit; its devices are freed after it either way",
                (_name(replica_replacement, "END_LEFTOVERS_TIMEOUT_S"),),
            )
        )
    if _select(config, "actor_rollout_ref.rollout.checkpoint_engine.backend", "") == "areal_gloo":
        import areal_plugins.weight_sync.gloo as gloo

        add(
            Limit(
                "a weight broadcast waiting for its peers (areal_gloo)",
                gloo.TIMEOUT_S,
                CONSTANT,
                "the peers' arrival at a collective (a dead worker, a wrong address), not the bytes' transfer time",
                (_name(gloo, "TIMEOUT_S"),),
            )
        )
    return limits


def format_limits(limits: list[Limit]) -> list[str]:
    """The list as lines: ``name: value (kind: source)``."""
    return [f"{limit.name}: {_seconds(limit.value_s)} ({limit.kind}: {limit.source})" for limit in limits]


def scorer_line(config: Any, cpu_nodes: int | None, cpus_per_node: int | None) -> str:
    """One line: the scoring processes per verl reward worker and where the count comes from."""
    count, kind, source = scorers(config, cpu_nodes, cpus_per_node)
    workers = reward_workers(config)
    shown = "sized at startup" if count is None else f"{count} per verl reward worker, {count * workers} in all"
    return f"reward scoring processes: {shown} ({kind}: {source})"


def cluster_cpus() -> tuple[int, int] | None:
    """``(nodes with CPUs, CPUs of the smallest)`` of the Ray cluster this process is connected to, as verl places its
    reward workers (alive nodes with a CPU resource); None: no such node."""
    import ray

    cpus = [int(node["Resources"]["CPU"]) for node in ray.nodes() if node["Alive"] and node["Resources"].get("CPU", 0)]
    return (len(cpus), min(cpus)) if cpus else None


def size_reward_scorers(config: Any, cpu_nodes: int, cpus_per_node: int) -> int | None:
    """Write the scoring processes per reward worker into the recipe's ``reward_kwargs`` (``areal_scorers``), where
    our reward (rewards/hooked.py) reads it when ``areal.reward.num_workers`` is null; returns it (None: the recipe's
    reward is not ours, nothing written)."""
    from omegaconf import open_dict

    kwargs: Any = _select(config, "reward.custom_reward_function.reward_kwargs", None)
    if kwargs is None or "areal_reward" not in kwargs:
        return None
    count, _, _ = scorers(config, cpu_nodes, cpus_per_node)
    share = sizing.core_share_per_worker(reward_workers(config), cpu_nodes, areal_settings(config).reward.cpu_share)
    with open_dict(kwargs):
        kwargs.areal_scorers = count
        kwargs.areal_scorer_core_share = share
    return count
