"""The verl-facing decoupled loss: the global token mean across micro-batches, and verl's cap."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from areal_plugins.config.routing import cap_threshold
from areal_plugins.config.settings import ArealConfig
from areal_plugins.trainer_workers.policy_loss import areal_decoupled_policy_loss


def actor_config(global_tokens=None, dp_size=1):
    info = {} if global_tokens is None else {"batch_num_tokens": global_tokens, "dp_size": dp_size}
    return OmegaConf.create(
        {
            "clip_ratio": 0.2,
            "clip_ratio_low": None,
            "clip_ratio_high": None,
            "clip_ratio_c": 3.0,
            "global_batch_info": info,
        }
    )


def batch(seed):
    g = torch.Generator().manual_seed(seed)
    old = torch.randn(4, 6, generator=g, dtype=torch.float64) * 0.1 - 1
    new = old + torch.randn(4, 6, generator=g, dtype=torch.float64) * 0.1
    behav = old + torch.randn(4, 6, generator=g, dtype=torch.float64) * 0.5
    adv = torch.randn(4, 6, generator=g, dtype=torch.float64)
    mask = torch.tensor([[1] * 6, [1] * 2 + [0] * 4, [1] * 5 + [0], [1] + [0] * 5], dtype=torch.bool)
    return old, new, behav, adv, mask


def reference_token_mean(old, new, behav, adv, mask, cap=None, mode="mask"):
    """Independent formula of docs/design.md (The decoupled objective) over the whole batch."""
    ratio = torch.exp(new - old)
    pg = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.2))
    pg = torch.where(adv < 0, torch.minimum(pg, -3.0 * adv), pg)
    w = torch.exp(old - behav)
    if cap is not None:
        w = torch.where(w > cap, torch.zeros_like(w), w) if mode == "mask" else w.clamp(max=cap)
    return (w * pg * mask).sum() / mask.sum()


def verl_truncated_weights(old, behav, mask, threshold):
    """What verl's rollout correction hands the loss for ``threshold``: verl's own function, as routed."""
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_weights

    weights, _ = compute_rollout_correction_weights(old - behav, mask.to(old.dtype), "token", threshold)
    return weights


def test_micro_batches_sum_to_the_global_token_mean():
    old, new, behav, adv, mask = batch(0)
    weights = torch.exp(old - behav) * mask
    total_tokens = int(mask.sum())
    parts = []
    for rows in (slice(0, 1), slice(1, 4)):  # 6 tokens vs 8 tokens: a mean of means would differ
        loss, metrics = areal_decoupled_policy_loss(
            old[rows], new[rows], adv[rows], mask[rows], "token-mean", actor_config(total_tokens), weights[rows]
        )
        parts.append(loss)
    torch.testing.assert_close(sum(parts), reference_token_mean(old, new, behav, adv, mask))
    assert "areal/behav_imp_weight_mean" in metrics and "actor/pg_clipfrac" in metrics


@pytest.mark.parametrize("mode", ["mask", "clamp"])
def test_cap_routed_through_verl_truncation_matches_the_formula(mode):
    old, new, behav, adv, mask = batch(1)
    config = ArealConfig.from_dict(
        {"enable": True, "loss": {"behav_imp_weight_cap": 1.5, "behav_imp_weight_mode": mode}}
    )
    weights = verl_truncated_weights(old, behav, mask, cap_threshold(config.loss))
    loss, metrics = areal_decoupled_policy_loss(old, new, adv, mask, "token-mean", actor_config(), weights)
    torch.testing.assert_close(loss, reference_token_mean(old, new, behav, adv, mask, cap=1.5, mode=mode))
    if mode == "mask":
        assert metrics["areal/behav_imp_weight_capped_frac"] > 0


def test_refuses_without_behaviour_weights_or_other_aggregation():
    old, new, _, adv, mask = batch(2)
    with pytest.raises(ValueError, match="rollout_is=token"):
        areal_decoupled_policy_loss(old, new, adv, mask, "token-mean", actor_config(), None)
    with pytest.raises(ValueError, match="loss_agg_mode=token-mean"):
        areal_decoupled_policy_loss(old, new, adv, mask, "seq-mean-token-sum", actor_config(), torch.ones_like(old))


def test_registered_in_verl():
    from verl.trainer.ppo.core_algos import get_policy_loss_fn

    assert get_policy_loss_fn("areal_decoupled") is areal_decoupled_policy_loss


# ---------------------------------------------------------------- prox_logp: loglinear


def loglinear_config(threshold, global_tokens=None):
    config = actor_config(global_tokens)
    config.policy_loss = {"rollout_correction": {"rollout_is_threshold": threshold}}
    return config


@pytest.mark.parametrize(("cap", "mode"), [(1.5, "mask"), (1.5, "clamp"), (None, "mask")])
def test_loglinear_equals_the_recomputed_objective_when_theta_is_prox(cap, mode):
    # One optimizer step per batch: at that step θ is π_prox, so the forward pass verl skips would
    # have returned exactly logp_θ. The loss must equal the reference with old := new.
    from areal_plugins.trainer_workers.policy_loss import areal_decoupled_loglinear_policy_loss

    _, new, behav, adv, mask = batch(3)
    threshold = cap_threshold(
        ArealConfig.from_dict({"loss": {"behav_imp_weight_cap": cap, "behav_imp_weight_mode": mode}}).loss
    )
    theta = new.clone().requires_grad_(True)
    loss, metrics = areal_decoupled_loglinear_policy_loss(behav, theta, adv, mask, config=loglinear_config(threshold))
    expected = reference_token_mean(new, new, behav, adv, mask, cap=cap, mode=mode)
    torch.testing.assert_close(loss.detach(), expected, rtol=1e-10, atol=1e-12)
    # Gradient: with r = 1 nothing is clipped, d/dθ [w · (-A r)] = -A w per token.
    loss.backward()
    w = torch.exp(new - behav)
    if cap is not None:
        w = torch.where(w > cap, torch.zeros_like(w), w) if mode == "mask" else w.clamp(max=cap)
    torch.testing.assert_close(theta.grad, -adv * w * mask / mask.sum(), rtol=1e-10, atol=1e-12)
    assert metrics["areal/behav_imp_weight_max"] == pytest.approx(float(torch.exp(new - behav)[mask].max()))


@pytest.mark.parametrize(
    ("threshold", "expected"), [("1e-12_5.0", (5.0, "mask")), (5.0, (5.0, "clamp")), (1e9, (None, "clamp"))]
)
def test_cap_threshold_round_trips(threshold, expected):
    from areal_plugins.config.routing import parse_cap_threshold

    assert parse_cap_threshold(threshold) == expected
