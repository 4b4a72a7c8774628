"""The ``areal:`` node of a recipe: one dataclass per feature, validated with the YAML path to change.

This module is the one source of every setting's default and help text: the Hydra config group that
ships the node (``areal_plugins/config/areal/default.yaml``) is generated from it
(``python tools/gen_default_config.py``; a test fails when the two differ). It imports nothing of
the package, of verl or of torch: which verl keys a setting drives lives in :mod:`areal_plugins.config.routing`.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import typing
from dataclasses import dataclass, field, fields
from typing import Any, Literal, get_args

#: ``areal.mode``; ``areal.placement``; ``areal.loss.prox_logp``: the choices, typed (mypy checks a comparison
#: or an assignment against them) and listed at run time (``__post_init__`` names them in its refusal).
Mode = Literal["async", "sync"]
Placement = Literal["colocated", "separate"]
ProxLogp = Literal["recompute", "loglinear"]
#: The same choices as :data:`areal_plugins.core.buffer.ON_STALE` and
#: :data:`areal_plugins.core.losses.WEIGHT_MODES` (a test ties them; this module stays a leaf).
OnStale = Literal["wait", "drop", "reissue"]
#: ``areal.weight_update.in_flight``: what a weight update does with the generations under way.
InFlight = Literal["interrupt", "wait"]
WeightMode = Literal["mask", "clamp"]
MODES: tuple[str, ...] = get_args(Mode)
PLACEMENTS: tuple[str, ...] = get_args(Placement)
PROX_LOGP: tuple[str, ...] = get_args(ProxLogp)
ON_STALE: tuple[str, ...] = get_args(OnStale)
WEIGHT_MODES: tuple[str, ...] = get_args(WeightMode)
IN_FLIGHT: tuple[str, ...] = get_args(InFlight)


class ArealConfigError(ValueError):
    """An invalid ``areal:`` setting; the message names the YAML path and what to change."""


@dataclass(frozen=True)
class LossConfig:
    """``areal.loss``: the decoupled PPO objective (docs/design.md, The decoupled objective)."""

    decoupled: bool = field(
        default=True,
        metadata={"help": "false: standard PPO with the behaviour log-probs as the old policy (ablation)"},
    )
    behav_imp_weight_cap: float | None = field(
        default=5.0, metadata={"help": "cap on w = π_prox/π_behav (> 1), null for none; paper: 5"}
    )
    behav_imp_weight_mode: WeightMode = field(
        default="mask", metadata={"help": "mask: drop tokens with w > cap; clamp: use min(w, cap)"}
    )
    prox_logp: ProxLogp = field(
        default="recompute",
        metadata={
            "help": "recompute: a forward pass gives π_prox; loglinear: interpolate from per-token versions "
            "(no forward pass; exact with one optimizer step per batch)"
        },
    )

    def __post_init__(self) -> None:
        cap = self.behav_imp_weight_cap
        if cap is not None and cap <= 1:
            raise ArealConfigError(f"areal.loss.behav_imp_weight_cap must be > 1 or null, got {cap}")
        if self.prox_logp not in PROX_LOGP:
            raise ArealConfigError(f"areal.loss.prox_logp must be one of {PROX_LOGP}, got {self.prox_logp!r}")
        if self.behav_imp_weight_mode not in WEIGHT_MODES:
            raise ArealConfigError(
                f"areal.loss.behav_imp_weight_mode must be one of {WEIGHT_MODES}, got {self.behav_imp_weight_mode!r}"
            )


@dataclass(frozen=True)
class RewardConfig:
    """``areal.reward``: where and how long rewards are computed."""

    service: bool = field(
        default=True, metadata={"help": "score in worker processes with a time limit (a hung verifier costs 0)"}
    )
    num_workers: int | None = field(
        default=None,
        metadata={
            "help": "scoring processes per verl reward worker (reward.num_workers of them). null: sized to the batch, "
            "min(ceil(A / R), floor(C x cpu_share / ceil(R / N)), min(32, C + 4)), at least 1, with A = "
            "data.train_batch_size x rollout.n answers a step, R = reward.num_workers, N the nodes with CPUs and C "
            "the CPUs of the smallest (docs/guides/limits.md)"
        },
    )
    cpu_share: float = field(
        default=0.5,
        metadata={
            "help": "with num_workers: null, the share of each node's CPUs the scoring processes may take (the rest: "
            "the engines', the trainer's and Ray's processes)"
        },
    )
    timeout_s: float = field(
        default=10.0,
        metadata={
            "help": "most seconds one reward may take for an answer of up to timeout_chars characters; longer "
            "answers get proportionally more (a 16k-token answer, ~64k characters, 160 s at the defaults)"
        },
    )
    timeout_chars: int = field(
        default=4096,
        metadata={"help": "answer length (characters) timeout_s is for; the limit grows linearly past it"},
    )
    retries: int = field(default=1, metadata={"help": "further attempts after a timeout or a crashed worker"})
    warn_timeout_share: float = field(
        default=0.01,
        metadata={
            "help": "warn once more than this share of a reward worker's answers got reward 0 by timing out "
            "(each such reward biases the advantages); counted per step in areal/reward_timeouts"
        },
    )

    def __post_init__(self) -> None:
        workers = self.num_workers
        if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int) or workers < 1):
            raise ArealConfigError(
                f"areal.reward.num_workers must be a process count >= 1 or null (sized to the batch), got {workers!r}"
            )
        share = self.cpu_share
        if isinstance(share, bool) or not isinstance(share, int | float) or not 0 < share <= 1:
            raise ArealConfigError(f"areal.reward.cpu_share must be a share in (0, 1], got {self.cpu_share!r}")
        if not self.timeout_s > 0:
            raise ArealConfigError(f"areal.reward.timeout_s must be > 0, got {self.timeout_s}")
        if self.retries < 0:
            raise ArealConfigError(f"areal.reward.retries must be >= 0, got {self.retries}")
        if not isinstance(self.timeout_chars, int) or self.timeout_chars < 1:
            raise ArealConfigError(
                f"areal.reward.timeout_chars must be a character count >= 1, got {self.timeout_chars!r}"
            )
        if not 0 <= self.warn_timeout_share <= 1:
            raise ArealConfigError(
                f"areal.reward.warn_timeout_share must be a share in [0, 1], got {self.warn_timeout_share!r}"
            )


@dataclass(frozen=True)
class MicroBatchConfig:
    """``areal.micro_batch``: how the trainer splits a batch for forward/backward."""

    max_tokens: int | None = field(
        default=None,
        metadata={
            "help": "token budget of one micro-batch, packed by first-fit-decreasing (paper's Algorithm 1), or "
            "where verl pads (model.use_remove_padding: false) cut into runs of like length, padded tokens counted; "
            "null: verl's own micro-batching"
        },
    )

    def __post_init__(self) -> None:
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens <= 0):
            raise ArealConfigError(
                f"areal.micro_batch.max_tokens must be a positive integer or null, got {self.max_tokens!r}"
            )


@dataclass(frozen=True)
class WeightUpdateConfig:
    """``areal.weight_update``: what an update does with generations under way (docs/design.md, Interruption)."""

    in_flight: InFlight = field(
        default="interrupt",
        metadata={
            "help": "interrupt: the update aborts the requests under way, which continue under the new weights "
            "(paper §4.1, interruptible rollout); wait: admission stops, every request under way finishes under "
            "the old weights, then the update runs (the paper's ablation without interruption; η still holds)"
        },
    )

    def __post_init__(self) -> None:
        if self.in_flight not in IN_FLIGHT:
            raise ArealConfigError(f"areal.weight_update.in_flight must be one of {IN_FLIGHT}, got {self.in_flight!r}")


@dataclass(frozen=True)
class EpisodesConfig:
    """``areal.episodes``: agent-loop episodes of several turns (docs/multi_turn.md)."""

    environment_timeout_s: float = field(
        default=120.0,
        metadata={
            "help": "most seconds an episode may spend outside the engine at a time (tool calls, environment "
            "steps); past it the episode fails, is counted and its group re-issued"
        },
    )

    def __post_init__(self) -> None:
        if not self.environment_timeout_s > 0:
            raise ArealConfigError(
                f"areal.episodes.environment_timeout_s must be > 0 seconds, got {self.environment_timeout_s!r}"
            )


@dataclass(frozen=True)
class ReplayConfig:
    """``areal.replay``: re-run a recorded asynchronous run by its record instead of the clock (docs/replay.md)."""

    run_dir: str | None = field(
        default=None,
        metadata={
            "help": "the recorded run's directory; null: not a replay. Set by areal-plugins replay, which also "
            "compares the two runs"
        },
    )

    from_step: int = field(
        default=0,
        metadata={
            "help": "0: replay from the first step; S: from the recorded run's checkpoint of step S (colocated runs). "
            "Set by areal-plugins replay --from-checkpoint"
        },
    )

    def __post_init__(self) -> None:
        if self.run_dir is not None and not isinstance(self.run_dir, str):
            raise ArealConfigError(f"areal.replay.run_dir must be a run directory's path or null, got {self.run_dir!r}")
        if isinstance(self.from_step, bool) or not isinstance(self.from_step, int) or self.from_step < 0:
            raise ArealConfigError(f"areal.replay.from_step must be a step number >= 0, got {self.from_step!r}")


@dataclass(frozen=True)
class CheckConfig:
    """``areal.check``: what ``areal-plugins check`` keeps in reserve on a GPU (docs/guides/sizing.md)."""

    memory_margin_gib: float = field(
        default=2.0,
        metadata={
            "help": "GiB a trainer or engine GPU must keep free beyond every counted term, for what check cannot "
            "count (the CUDA caching allocator's fragmentation, which depends on allocation order); a GPU that fits "
            "with less is refused, naming its spare. 0: fit to the byte"
        },
    )

    def __post_init__(self) -> None:
        margin = self.memory_margin_gib
        if isinstance(margin, bool) or not isinstance(margin, int | float) or margin < 0:
            raise ArealConfigError(f"areal.check.memory_margin_gib must be GiB >= 0 (0: no margin), got {margin!r}")


@dataclass(frozen=True)
class PluginsConfig:
    """``areal.plugins``: which installed third-party plugins to load."""

    include: list[str] | None = field(
        default=None,
        metadata={"help": "installed plugin (entry-point) names to load; null: all but opt-in ones (m2po)"},
    )
    exclude: list[str] = field(default_factory=list, metadata={"help": "installed plugin names to skip"})

    def __post_init__(self) -> None:
        for key in ("include", "exclude"):
            value = getattr(self, key)
            if value is None and key == "include":
                continue
            if not isinstance(value, list | tuple) or not all(isinstance(name, str) for name in value):
                raise ArealConfigError(
                    f"areal.plugins.{key} must be a list of plugin names, e.g. [my_plugin], got {value!r}"
                )


@dataclass(frozen=True)
class ArealConfig:
    """``areal``: switch and settings of areal_plugins."""

    enable: bool = field(default=False, metadata={"help": "true turns our features on; false leaves verl as is"})
    mode: Mode = field(default="async", metadata={"help": "async or sync training"})
    max_staleness: int = field(
        default=4,
        metadata={
            "help": "η: staleness bound, by count at admission (per sample with on_stale: reissue or drop); "
            "0 = synchronous; paper: 4-8"
        },
    )
    placement: Placement = field(
        default="colocated",
        metadata={"help": "colocated: engines pause while the trainer trains; separate: both run all the time"},
    )
    on_stale: OnStale = field(
        default="wait",
        metadata={
            "help": "a buffered group beyond η at consumption: wait = train on it, drop = reject, "
            "reissue = generate it again under the current weights (strict per-sample bound)"
        },
    )
    max_concurrent_rollouts: int | None = field(
        default=None, metadata={"help": "most prompt groups in flight; null: (max_staleness + 1) x train_batch_size"}
    )
    poll_interval_s: float = field(
        default=0.05, metadata={"help": "seconds between the admission loop's looks at finished rollouts"}
    )
    watchdog_s: float = field(
        default=900.0,
        metadata={"help": "stop with a report when the trainer waits this long with no rollout progress"},
    )
    max_restarts: int = field(
        default=0,
        metadata={
            "help": "areal-plugins train resumes a failed run from its last checkpoint up to this many times "
            "(needs trainer.save_freq; --max-restarts overrides)"
        },
    )
    replace_dead_replicas: bool = field(
        default=True,
        metadata={
            "help": "placement: separate: start a replacement for a rollout replica that died, where Ray can place "
            "it; it takes requests once the next weight sync has loaded and checked the current weights"
        },
    )
    replica_start_timeout_s: float | None = field(
        default=None,
        metadata={
            "help": "placement: separate: the longest a replica started mid-run (a replacement or growth) may take, "
            "waiting for a node with its devices included; past it the start is abandoned and recorded. null: 3x "
            "the measured start of the run's replicas"
        },
    )
    max_rollout_replicas: int | None = field(
        default=None,
        metadata={
            "help": "placement: separate: start more rollout replicas mid-run, up to this many, whenever Ray has the "
            "devices for one (a node joined the cluster); each takes requests after a weight sync. null: the "
            "recipe's count"
        },
    )
    waive_capabilities: list[str] = field(
        default_factory=list,
        metadata={
            "help": "rollout-backend capabilities to run without (verl's own sglang lacks some); "
            "refused at startup unless named here"
        },
    )
    loss: LossConfig = field(default_factory=LossConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    micro_batch: MicroBatchConfig = field(default_factory=MicroBatchConfig)
    weight_update: WeightUpdateConfig = field(default_factory=WeightUpdateConfig)
    episodes: EpisodesConfig = field(default_factory=EpisodesConfig)
    plugins: PluginsConfig = field(default_factory=PluginsConfig)
    replay: ReplayConfig = field(default_factory=ReplayConfig)
    check: CheckConfig = field(default_factory=CheckConfig)

    def __post_init__(self) -> None:
        if not isinstance(self.enable, bool):
            raise ArealConfigError(f"areal.enable must be true or false, got {self.enable!r}")
        if self.mode not in MODES:
            raise ArealConfigError(f"areal.mode must be one of {MODES}, got {self.mode!r}")
        if not isinstance(self.max_staleness, int) or self.max_staleness < 0:
            raise ArealConfigError(
                f"areal.max_staleness must be an integer >= 0 (0 = synchronous), got {self.max_staleness!r}"
            )
        if self.placement not in PLACEMENTS:
            raise ArealConfigError(f"areal.placement must be one of {PLACEMENTS}, got {self.placement!r}")
        if self.on_stale not in ON_STALE:
            raise ArealConfigError(f"areal.on_stale must be one of {ON_STALE}, got {self.on_stale!r}")
        if self.max_concurrent_rollouts is not None and self.max_concurrent_rollouts < 1:
            raise ArealConfigError(
                f"areal.max_concurrent_rollouts must be >= 1 or null, got {self.max_concurrent_rollouts!r}"
            )
        if self.max_rollout_replicas is not None and (
            not isinstance(self.max_rollout_replicas, int) or self.max_rollout_replicas < 1
        ):
            raise ArealConfigError(
                f"areal.max_rollout_replicas must be a replica count >= 1 or null, got {self.max_rollout_replicas!r}"
            )
        if self.max_rollout_replicas is not None and self.placement != "separate":
            raise ArealConfigError(
                "areal.max_rollout_replicas grows the standalone replicas of areal.placement: separate; colocated "
                "engines live in the trainer's workers. Remove it, or set areal.placement: separate"
            )
        timeout = self.replica_start_timeout_s
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, int | float) or timeout <= 0):
            raise ArealConfigError(
                f"areal.replica_start_timeout_s must be seconds > 0 or null (3x the measured start), got {timeout!r}"
            )
        if not isinstance(self.max_restarts, int) or self.max_restarts < 0:
            raise ArealConfigError(f"areal.max_restarts must be an integer >= 0, got {self.max_restarts!r}")
        if not self.watchdog_s > 0:
            raise ArealConfigError(f"areal.watchdog_s must be > 0 seconds, got {self.watchdog_s!r}")
        if not self.poll_interval_s > 0:
            raise ArealConfigError(f"areal.poll_interval_s must be > 0, got {self.poll_interval_s!r}")
        waived = self.waive_capabilities
        if not isinstance(waived, list | tuple) or not all(isinstance(name, str) for name in waived):
            raise ArealConfigError(
                f"areal.waive_capabilities must be a list of capability names, e.g. [weight_checksum], got {waived!r}"
            )

    @property
    def async_trainer(self) -> bool:
        """Whether the run uses our asynchronous trainer (``areal.enable: true`` with ``areal.mode: async``)."""
        return self.enable and self.mode == "async"

    def concurrent_rollouts(self, batch_size: int) -> int:
        """Most prompt groups admitted at once: ``areal.max_concurrent_rollouts``, else (η + 1) x B.

        With η = ``max_staleness`` and B = ``data.train_batch_size`` prompt groups, (η + 1) x B is the staleness
        bound's capacity at version 0 with nothing accepted, (η + v + 1) x B - (accepted + running) at v = 0
        (AReaL, arXiv 2505.24298 §5.1; :mod:`areal_plugins.core.staleness`). The one place this default is
        computed.
        """
        if self.max_concurrent_rollouts is not None:
            return int(self.max_concurrent_rollouts)
        return (self.max_staleness + 1) * int(batch_size)

    @classmethod
    def from_dict(cls, values: dict[str, Any] | None) -> ArealConfig:
        """Build from the plain ``areal:`` mapping; unknown keys fail with the closest valid key."""
        return _build(cls, dict(values or {}), "areal")

    @classmethod
    def from_node(cls, node: Any) -> ArealConfig:
        """Build from the recipe's ``areal`` node: an OmegaConf node (resolved here) or a plain mapping."""
        from omegaconf import OmegaConf

        values = OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else node
        if cls is not ArealConfig:
            return cls.from_dict(values)  # type: ignore[arg-type]
        try:
            key = json.dumps(values, sort_keys=True)
        except (TypeError, ValueError):  # not plain data: parsed (and refused) uncached
            return cls.from_dict(values)  # type: ignore[arg-type]
        return _parsed(key)


@functools.lru_cache(maxsize=32)
def _parsed(key: str) -> ArealConfig:
    """:meth:`ArealConfig.from_dict` of a node's JSON text: frozen settings, shared by every reader of that node."""
    return ArealConfig.from_dict(json.loads(key))


def areal_settings(config: Any) -> ArealConfig:
    """The typed settings of a whole recipe (its ``areal`` node; every default where the node is absent).

    The one way code outside this package's ``config/`` reads ``areal.*`` given the whole verl config: no module
    reads a raw ``areal`` key (a test holds it), so every default is the one declared here. Parsed once per distinct
    node: the result is cached by the node's resolved contents, so a node changed in place is parsed again.
    """
    node = config.get("areal") if config is not None and hasattr(config, "get") else None
    return ArealConfig.from_node(node)


def _build(cls: type, values: dict[str, Any], path: str) -> Any:
    known = {f.name: f for f in fields(cls)}
    for key in values:
        if key not in known:
            close = difflib.get_close_matches(key, list(known), n=1)
            hint = f"; did you mean {path}.{close[0]}?" if close else f"; valid keys: {', '.join(sorted(known))}"
            raise ArealConfigError(f"unknown setting {path}.{key}{hint}")
    sections = nested_sections(cls)
    kwargs = {}
    for key, value in values.items():
        if key in sections:
            if not isinstance(value, dict):
                raise ArealConfigError(f"{path}.{key} must be a mapping, got {value!r}")
            value = _build(sections[key], value, f"{path}.{key}")
        kwargs[key] = value
    return cls(**kwargs)


def nested_sections(cls: type) -> dict[str, type]:
    """The fields of ``cls`` that are sections of their own (typed with a dataclass)."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in fields(cls) if dataclasses.is_dataclass(hints[f.name])}
