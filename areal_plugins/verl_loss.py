"""The decoupled PPO objective as verl's policy loss ``areal_decoupled`` (``register_policy_loss``).

verl hands a policy loss ``old_log_prob`` (π_prox: verl recomputes it with the trainer's weights
before the update), ``log_prob`` (π_θ) and ``rollout_is_weights``. With
``algorithm.rollout_correction.rollout_is: token`` and an upper threshold that never binds, verl
computes those weights as ``exp(old_log_prob - rollout_log_prob)`` = w_t of the decoupled objective
(the rollout log-probs are the engine's per-token behaviour log-probs), so the behaviour log-probs
are ``old_log_prob - log w``. The cap is ours (mask or clamp), applied exactly as DESIGN.md §1 says.

Aggregation: verl's ``token-mean`` divides by the token count of the *global* batch and multiplies
by the data-parallel size; :func:`decoupled_ppo_loss` returns the micro-batch token mean, so it is
rescaled by ``local_tokens / global_tokens * dp_size`` — the sum over micro-batches and ranks is then
the global token mean, not a mean of micro-batch means.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

import torch

from areal_plugins.losses import WEIGHT_MODES, decoupled_ppo_loss

LOSS_NAME = "areal_decoupled"
#: Ray forwards this variable from the driver to every worker (the recipe sets it from ``areal.loss``):
#: verl's actor config has no room for our knobs, and unknown keys there are rejected.
SETTINGS_ENV = "AREAL_LOSS_SETTINGS"


@dataclass(frozen=True)
class LossSettings:
    """The knobs of ``areal.loss`` the worker-side loss needs."""

    behav_imp_weight_cap: float | None = 5.0
    behav_imp_weight_mode: str = "mask"

    def __post_init__(self) -> None:
        if self.behav_imp_weight_cap is not None and self.behav_imp_weight_cap <= 1:
            raise ValueError(f"areal.loss.behav_imp_weight_cap must be > 1 or null, got {self.behav_imp_weight_cap}")
        if self.behav_imp_weight_mode not in WEIGHT_MODES:
            raise ValueError(
                f"areal.loss.behav_imp_weight_mode must be one of {WEIGHT_MODES}, got {self.behav_imp_weight_mode!r}"
            )

    @classmethod
    def from_env(cls) -> LossSettings:
        raw = os.environ.get(SETTINGS_ENV)
        if not raw:
            return cls()
        values = json.loads(raw)
        known = {k: values[k] for k in ("behav_imp_weight_cap", "behav_imp_weight_mode") if k in values}
        return cls(**known)


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
    if loss_agg_mode != "token-mean":
        raise ValueError(
            f"policy loss {LOSS_NAME} implements the paper's global token mean; set "
            f"actor_rollout_ref.actor.loss_agg_mode=token-mean (got {loss_agg_mode!r})"
        )
    if rollout_is_weights is None:
        raise ValueError(
            f"policy loss {LOSS_NAME} needs the behaviour importance weights: set "
            "algorithm.rollout_correction.rollout_is=token, algorithm.rollout_correction.rollout_is_threshold=1e9 "
            "and actor_rollout_ref.rollout.calculate_log_probs=true"
        )
    settings = LossSettings.from_env()
    mask = response_mask.to(torch.bool)
    # log w; masked-out entries (weight 0) become -inf and are excluded by the mask.
    behav_log_prob = old_log_prob - torch.log(rollout_is_weights)
    clip_low = config.clip_ratio_low if config.clip_ratio_low is not None else config.clip_ratio
    clip_high = config.clip_ratio_high if config.clip_ratio_high is not None else config.clip_ratio
    loss, stats = decoupled_ppo_loss(
        log_prob,
        old_log_prob,
        behav_log_prob,
        advantages,
        mask,
        eps_clip=clip_low,
        eps_clip_higher=clip_high,
        c_clip=config.get("clip_ratio_c", 3.0),
        behav_imp_weight_cap=settings.behav_imp_weight_cap,
        behav_imp_weight_mode=settings.behav_imp_weight_mode,
    )
    info = getattr(config, "global_batch_info", None) or {}
    global_tokens = info.get("batch_num_tokens")
    if global_tokens is not None:
        local_tokens = mask.sum()
        loss = loss * local_tokens / global_tokens * info.get("dp_size", 1)
    metrics = {f"areal/{key}": value for key, value in stats.items() if key != "num_tokens"}
    metrics["actor/pg_clipfrac"] = stats["clip_frac"]
    metrics["actor/pg_clipfrac_lower"] = stats["dual_clip_frac"]
    return loss, metrics


def register_policy_loss_with_verl() -> None:
    """Register ``areal_decoupled`` in verl's policy-loss registry (idempotent)."""
    from verl.trainer.ppo import core_algos

    if LOSS_NAME not in core_algos.POLICY_LOSS_REGISTRY:
        core_algos.register_policy_loss(LOSS_NAME)(areal_decoupled_policy_loss)
