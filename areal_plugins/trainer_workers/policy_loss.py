"""The decoupled PPO objective as verl's policy loss ``areal_decoupled`` (``register_policy_loss``).

verl hands a policy loss ``old_log_prob`` (π_prox: verl recomputes it with the trainer's weights
before the update), ``log_prob`` (π_θ) and ``rollout_is_weights``. With
``algorithm.rollout_correction.rollout_is: token`` verl computes those weights as
``exp(old_log_prob - rollout_log_prob)`` = w_t of the decoupled objective (the rollout log-probs are
the engine's per-token behaviour log-probs) and applies our cap through ``rollout_is_threshold``
(``areal.loss`` routes it: ``"1e-12_CAP"`` zeroes w > CAP = mode mask, a plain ``CAP`` clamps =
mode clamp; see :func:`areal_plugins.config.routing.cap_threshold`). Capped weights reach this loss
already capped; verl logs the capped fraction as ``rollout_corr/rollout_is_ratio_fraction_high``.

Aggregation: verl's ``token-mean`` divides by the token count of the *global* batch and multiplies
by the data-parallel size; :func:`decoupled_ppo_loss` returns the micro-batch token mean, so it is
rescaled by ``local_tokens / global_tokens * dp_size`` — the sum over micro-batches and ranks is then
the global token mean, not a mean of micro-batch means.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from areal_plugins.config.routing import LOGLINEAR_LOSS_NAME, RECOMPUTE_LOSS_NAME, parse_cap_threshold
from areal_plugins.core.losses import decoupled_ppo_loss
from areal_plugins.testing.faults import fault_plan
from areal_plugins.trainer_workers.router_replay import replay_metrics

LOSS_NAME = RECOMPUTE_LOSS_NAME


def areal_decoupled_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """verl ``PolicyLossFn`` computing :func:`decoupled_ppo_loss` over the global batch."""
    _require_token_mean(LOSS_NAME, loss_agg_mode)
    if delay := fault_plan().trainer_microbatch_delay_s:  # the tests' slow trainer (testing/faults.py)
        time.sleep(delay)
    if rollout_is_weights is None:
        raise ValueError(
            f"policy loss {LOSS_NAME} needs the behaviour importance weights: set "
            "algorithm.rollout_correction.rollout_is=token and actor_rollout_ref.rollout.calculate_log_probs=true "
            "(areal.enable: true sets both)"
        )
    mask = response_mask.to(torch.bool)
    # w arrives capped by verl. Tokens it dropped (w = 0) add nothing to the numerator but count in
    # the denominator: compute over the kept tokens, then rescale by kept / all.
    dropped = mask & (rollout_is_weights <= 0)
    kept = mask & ~dropped
    weights = torch.where(kept, rollout_is_weights, torch.ones_like(rollout_is_weights))
    behav_log_prob = old_log_prob - torch.log(weights)
    loss, stats = pure_loss()(log_prob, old_log_prob, behav_log_prob, advantages, kept, **_clips(config))
    # That is the mean over kept tokens; the paper's denominator counts every token of the global
    # batch (per rank: global tokens / dp size), dropped ones included.
    loss = loss * kept.sum() / _local_denominator(config, mask)
    stats["behav_imp_weight_capped_frac"] = float(dropped.sum()) / max(int(mask.sum()), 1)
    return loss, _metrics(stats)


def areal_decoupled_loglinear_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """verl ``PolicyLossFn`` of the decoupled objective with π_prox from the log-linear rule (no forward pass).

    verl runs in bypass mode here: ``old_log_prob`` holds the behaviour log-probs
    (docs/design.md, The decoupled objective):
    logp_prox = logp_behav + α (logp_θ - logp_behav) with α = clamp((v_prox - v_behav) / (v_θ - v_behav), 0, 1).
    With one optimizer step per batch (checked by the trainer) θ *is* the proximal policy, v_θ = v_prox,
    so α = 1 for every token a past version generated, and for tokens of the current version
    logp_behav = logp_θ: in both cases logp_prox = logp_θ (no gradient), exactly, without recomputing it.
    The cap comes from ``actor.policy_loss.rollout_correction.rollout_is_threshold`` (routed by ``areal.loss``).
    """
    _require_token_mean(LOGLINEAR_LOSS_NAME, loss_agg_mode)
    if delay := fault_plan().trainer_microbatch_delay_s:  # the tests' slow trainer (testing/faults.py)
        time.sleep(delay)
    correction = config.policy_loss.get("rollout_correction", None) or {}
    cap, mode = parse_cap_threshold(correction.get("rollout_is_threshold", 2.0))
    mask = response_mask.to(torch.bool)
    proximal = log_prob.detach()
    loss, stats = pure_loss()(
        log_prob,
        proximal,
        old_log_prob,
        advantages,
        mask,
        behav_imp_weight_cap=cap,
        behav_imp_weight_mode=mode,
        **_clips(config),
    )
    loss = loss * mask.sum() / _local_denominator(config, mask)
    return loss, _metrics(stats)


def _require_token_mean(loss_name: str, loss_agg_mode: str) -> None:
    if loss_agg_mode != "token-mean":
        raise ValueError(
            f"policy loss {loss_name} implements the paper's global token mean; set "
            f"actor_rollout_ref.actor.loss_agg_mode=token-mean (got {loss_agg_mode!r})"
        )


_pure_loss: Any = None


def pure_loss() -> Any:
    """The loss the ``areal_make_policy_loss`` hook chose in this worker (asked once per process)."""
    global _pure_loss
    if _pure_loss is None:
        from areal_plugins.hooks.contracts import PolicyLoss, require_contract
        from areal_plugins.plugin_manager import HOOKS

        chosen = HOOKS.make_policy_loss() or decoupled_ppo_loss
        require_contract(chosen, PolicyLoss, "areal_make_policy_loss")
        _pure_loss = chosen
    return _pure_loss


def _clips(config: Any) -> dict[str, Any]:
    clip_low = config.clip_ratio_low if config.clip_ratio_low is not None else config.clip_ratio
    clip_high = config.clip_ratio_high if config.clip_ratio_high is not None else config.clip_ratio
    return {"eps_clip": clip_low, "eps_clip_higher": clip_high, "c_clip": config.get("clip_ratio_c", 3.0)}


def _local_denominator(config: Any, mask: torch.Tensor) -> torch.Tensor | float:
    """This rank's share of the global batch's token count (verl's ``global_batch_info``)."""
    info = getattr(config, "global_batch_info", None) or {}
    global_tokens = info.get("batch_num_tokens")
    return mask.sum().clamp(min=1) if global_tokens is None else global_tokens / info.get("dp_size", 1)


def _metrics(stats: dict[str, float]) -> dict[str, Any]:
    metrics = {f"areal/{key}": value for key, value in stats.items() if key != "num_tokens"}
    metrics["actor/pg_clipfrac"] = stats["clip_frac"]
    metrics["actor/pg_clipfrac_lower"] = stats["dual_clip_frac"]
    metrics.update(replay_metrics())  # this micro-batch's router replay, where routes are replayed (R3)
    return metrics


def register_policy_loss_with_verl() -> None:
    """Register ``areal_decoupled`` and ``areal_decoupled_loglinear`` with verl (idempotent)."""
    from verl.trainer.ppo import core_algos

    for name, loss in (
        (RECOMPUTE_LOSS_NAME, areal_decoupled_policy_loss),
        (LOGLINEAR_LOSS_NAME, areal_decoupled_loglinear_policy_loss),
    ):
        if name not in core_algos.POLICY_LOSS_REGISTRY:
            core_algos.register_policy_loss(name)(loss)
