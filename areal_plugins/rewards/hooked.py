"""verl's ``custom_reward_function`` entry that asks the ``areal_make_reward_fn`` hook for the reward.

Recipes point ``reward.custom_reward_function`` here and pass the ``areal:`` switch and plugin
selection through ``reward_kwargs`` (verl's own seam for arguments of a custom reward), so the reward
worker processes load the same plugin set as the driver, and ``areal.reward``: with ``service: true``
each score runs in a :class:`RewardService` worker process with a time limit (a hung, raising or
crashing verifier costs that one reward, counted and logged). With ``areal_enable: false`` no hook is
called and nothing changes: the math-verify reward runs in-process, as verl would run it.
"""

from __future__ import annotations

import logging
import os
import pickle
import threading
from collections.abc import Callable
from typing import Any, cast

from areal_plugins.rewards.math_verify_reward import compute_score as math_verify_score
from areal_plugins.rewards.service import RewardService
from areal_plugins.rewards.sizing import capped_by_cores

logger = logging.getLogger(__name__)

_lock = threading.Lock()
_chosen: dict[tuple, Callable[..., float]] = {}


def _reward_fn(enable: bool, plugins: dict[str, Any]) -> Callable[..., float]:
    include = plugins.get("include")
    exclude = list(plugins.get("exclude") or [])
    key = (enable, tuple(include) if include is not None else None, tuple(exclude))
    with _lock:
        if key not in _chosen:
            if not enable:
                _chosen[key] = math_verify_score
            else:
                from areal_plugins.hooks.contracts import RewardFunction, require_contract
                from areal_plugins.plugin_manager import HOOKS, configure_plugins

                if include is not None or exclude:  # the default set needs no rebuild
                    configure_plugins(include=include, exclude=exclude)
                settings = {"areal": {"enable": enable, "plugins": dict(plugins)}}
                fn = HOOKS.make_reward_fn(config=settings)
                require_contract(fn, RewardFunction, "areal_make_reward_fn")  # refuses None too
                _chosen[key] = cast("Callable[..., float]", fn)
        return _chosen[key]


_services: dict[tuple, RewardService] = {}


def scorers_for(
    settings: dict[str, Any], sized: int | None, core_share: float | None = None, cores: int | None = None
) -> int:
    """The scoring processes of this reward worker: ``areal.reward.num_workers`` when the recipe sets it, else what
    the driver sized to the batch (``reward_kwargs.areal_scorers``, from
    :func:`~areal_plugins.rewards.sizing.scorer_processes`) capped at this node's ``cores`` (default: the cores this
    process may run on) x ``core_share`` (``reward_kwargs.areal_scorer_core_share``), else 1 (a trainer that sized
    nothing started it)."""
    configured = settings.get("num_workers")
    if configured is not None:
        return int(configured)
    if sized is None:
        return 1
    if core_share is None:
        return int(sized)
    return capped_by_cores(int(sized), cores if cores is not None else len(os.sched_getaffinity(0)), core_share)


def _service(
    fn: Callable[..., float], settings: dict[str, Any], sized: int | None = None, core_share: float | None = None
) -> RewardService | None:
    """This process's reward service for ``fn`` (None: score in-process)."""
    if not settings.get("service", False):
        return None
    key = (
        fn,
        scorers_for(settings, sized, core_share),
        settings.get("timeout_s", 10.0),
        settings.get("retries", 1),
        settings.get("timeout_chars", 4096),
        settings.get("warn_timeout_share", 0.01),
    )
    with _lock:
        if key not in _services:
            try:
                pickle.dumps(fn)
            except Exception:
                logger.warning("reward function %r cannot be sent to worker processes; scoring in-process", fn)
                return None
            _services[key] = RewardService(
                fn,
                num_workers=key[1],
                timeout_s=key[2],
                retries=key[3],
                timeout_chars=key[4],
                warn_timeout_share=key[5],
            )
            logger.info("areal: %d reward scoring processes in this reward worker (sized %s)", key[1], sized)
        return _services[key]


def compute_score(
    data_source: str,
    solution_str: str,
    ground_truth: str,
    extra_info: dict[str, Any] | None = None,
    areal_enable: bool = False,
    areal_plugins: dict[str, Any] | None = None,
    areal_reward: dict[str, Any] | None = None,
    areal_scorers: int | None = None,
    areal_scorer_core_share: float | None = None,
    **kwargs: Any,
) -> float | dict[str, float]:
    """The reward of ``solution_str`` from the hook-chosen function (math-verify by default).

    Through the reward service the result is verl's dict form: ``score``, ``acc`` (what verl records
    for a plain float) and the service's report (latency, failure, timeouts, crashes), which verl
    keeps per trajectory in ``reward_extra_info`` and our trainer turns into ``areal/reward_*`` metrics.
    ``areal_scorers``: the scoring processes our driver sized to the batch, ``areal_scorer_core_share`` the share of
    this node's cores they may take (:func:`scorers_for`).
    """
    fn = _reward_fn(bool(areal_enable), dict(areal_plugins or {}))
    settings = dict(areal_reward or {})
    service = _service(fn, settings, areal_scorers, areal_scorer_core_share) if areal_enable else None
    if service is not None:
        report = service.score_with_report(data_source, solution_str, ground_truth, extra_info)
        return {"score": report.score, "acc": report.score, **report.as_extra_info()}
    return float(fn(data_source, solution_str, ground_truth, extra_info))
