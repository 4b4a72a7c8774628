"""Our decoupled loss against verl 0.9.1's own composition of the same objective, on random cases.

verl's composition is what verl runs with ``policy_loss.loss_mode=vanilla`` and
``algorithm.rollout_correction.rollout_is=token``: the driver's ``compute_rollout_correction_and_add_to_batch``
(``verl/trainer/ppo/rollout_corr_helper.py``) turns π_prox (``old_log_probs``) and π_behav (``rollout_log_probs``)
into detached per-token weights, truncated by ``rollout_is_threshold``, and the trainer's
``compute_policy_loss_vanilla`` (``verl/trainer/ppo/core_algos.py``) multiplies its clipped, dual-clipped PPO term by
them and aggregates with ``agg_loss`` over the global batch. Both are verl's functions, called here, never re-written.

Ours is ``areal_decoupled`` (``areal_plugins/trainer_workers/policy_loss.py``) fed the same verl weights, and the pure
oracle ``decoupled_ppo_loss`` (``areal_plugins/core/losses.py``) fed the behaviour log-probs themselves. Findings
(docs/design.md, Decoupled loss and verl's vanilla loss): the loss and its gradient w.r.t. ``log_prob`` are equal to
float64 rounding in every case below; the statistics are not (the tests at the end pin each difference).
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest
import torch
from verl.protocol import DataProto
from verl.trainer.config.algorithm import RolloutCorrectionConfig
from verl.trainer.ppo.core_algos import agg_loss, compute_policy_loss_bypass_mode, compute_policy_loss_vanilla
from verl.trainer.ppo.rollout_corr_helper import (
    compute_rollout_correction_and_add_to_batch,
    compute_rollout_correction_weights,
)
from verl.workers.config.actor import ActorConfig, PolicyLossConfig

from areal_plugins.config.routing import NO_CAP, cap_threshold
from areal_plugins.config.settings import LossConfig
from areal_plugins.core.losses import decoupled_ppo_loss
from areal_plugins.trainer_workers.policy_loss import (
    areal_decoupled_loglinear_policy_loss,
    areal_decoupled_policy_loss,
)

TOL = {"rtol": 1e-12, "atol": 1e-14}

#: ``areal.loss`` cap settings: none, the recipes' (the paper's 5, mask), and a low cap so that many tokens hit it.
CAPS = {
    "no cap": LossConfig(behav_imp_weight_cap=None),
    "mask 5 (recipes)": LossConfig(behav_imp_weight_cap=5.0, behav_imp_weight_mode="mask"),
    "mask 1.5": LossConfig(behav_imp_weight_cap=1.5, behav_imp_weight_mode="mask"),
    "clamp 1.5": LossConfig(behav_imp_weight_cap=1.5, behav_imp_weight_mode="clamp"),
}
#: actor clip settings (clip_ratio, clip_ratio_low, clip_ratio_high, clip_ratio_c): the recipes' symmetric 0.2 with
#: verl's default dual clip c = 3, an asymmetric clip (DAPO's 0.2 / 0.28), and a dual clip that binds often.
CLIPS = {
    "symmetric 0.2, c 3 (recipes)": (0.2, None, None, 3.0),
    "asymmetric 0.2/0.28": (0.2, 0.2, 0.28, 3.0),
    "dual clip c 1.5": (0.2, None, None, 1.5),
}
#: (rows, response length, seed): one token; a few padded rows; a batch of GRPO-sized groups.
SHAPES = [(1, 1, 0), (4, 7, 1), (16, 33, 2)]


def actor_config(clips, threshold=2.0, bypass=False):
    """verl's own ``ActorConfig`` as the trainer builds it (the loss reads the clips and ``global_batch_info``)."""
    clip_ratio, low, high, c = clips
    correction = RolloutCorrectionConfig(
        rollout_is="token", rollout_is_threshold=threshold, bypass_mode=bypass, loss_type="reinforce"
    )
    return ActorConfig(
        strategy="fsdp",
        clip_ratio=clip_ratio,
        clip_ratio_low=low,
        clip_ratio_high=high,
        clip_ratio_c=c,
        ppo_mini_batch_size=1,
        ppo_micro_batch_size_per_gpu=1,
        rollout_n=1,
        policy_loss=PolicyLossConfig(rollout_correction=correction),
    )


def random_case(rows, length, seed, stale=0.8, step=0.4):
    """Log-probs of π_prox, π_θ and a stale π_behav, mixed-sign advantages and right-padded masks (float64).

    ``stale`` spreads log w = log π_prox - log π_behav (so w ranges over ~[0.1, 10]: some above each cap); ``step``
    spreads log r = log π_θ - log π_prox (so both clip bounds and the dual clip are crossed).
    """
    g = torch.Generator().manual_seed(seed)
    prox = -torch.rand(rows, length, generator=g, dtype=torch.float64) * 3 - 0.01
    behav = prox + torch.randn(rows, length, generator=g, dtype=torch.float64) * stale
    theta = prox + torch.randn(rows, length, generator=g, dtype=torch.float64) * step
    adv = torch.randn(rows, length, generator=g, dtype=torch.float64)
    lengths = torch.randint(1, length + 1, (rows,), generator=g)
    lengths[0] = length  # at least one full row
    mask = torch.arange(length)[None, :] < lengths[:, None]
    return prox, behav, theta, adv, mask


def verl_weights(prox, behav, mask, threshold):
    """The driver's rollout correction: ``rollout_is_weights`` and its ``rollout_corr/`` metrics."""
    batch = DataProto.from_dict(
        tensors={"old_log_probs": prox, "rollout_log_probs": behav, "response_mask": mask.to(prox.dtype)}
    )
    config = RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold=threshold)
    batch, metrics = compute_rollout_correction_and_add_to_batch(batch, config)
    return batch.batch["rollout_is_weights"], metrics


def micro_batches(rows, dp_size):
    """Row slices of ``dp_size`` ranks x 2 micro-batches each (a single row stays one micro-batch)."""
    if rows < 2 * dp_size:
        return [slice(0, rows)]
    bounds = torch.linspace(0, rows, 2 * dp_size + 1).round().long().tolist()
    return [slice(a, b) for a, b in itertools.pairwise(bounds)]


def run_loss(loss_fn, prox_in, theta, adv, mask, weights, config, dp_size):
    """Every micro-batch's loss as verl's actor calls the loss, summed over micro-batches and averaged over the
    ranks (what FSDP's gradient all-reduce makes of them): the loss and d loss / d log_prob of the global batch."""
    theta = theta.clone().requires_grad_(True)
    global_tokens = int(mask.sum())
    total = torch.zeros((), dtype=theta.dtype)
    metrics = []
    for rows in micro_batches(mask.shape[0], dp_size):
        # verl's ppo_loss sets these per micro-batch (verl/workers/utils/losses.py).
        config.global_batch_info.update(
            dp_size=dp_size, batch_num_tokens=global_tokens, global_batch_size=mask.shape[0], loss_scale_factor=None
        )
        w = None if weights is None else weights[rows]
        loss, stats = loss_fn(prox_in[rows], theta[rows], adv[rows], mask[rows], "token-mean", config, w)
        total = total + loss / dp_size
        metrics.append(stats)
    total.backward()
    return total.detach(), theta.grad, metrics


def oracle(prox, behav, theta, adv, mask, clips, loss_config):
    """``core/losses.py`` over the whole batch with the behaviour log-probs (no verl involved)."""
    clip_ratio, low, high, c = clips
    theta = theta.clone().requires_grad_(True)
    loss, _ = decoupled_ppo_loss(
        theta,
        prox,
        behav,
        adv,
        mask,
        eps_clip=low if low is not None else clip_ratio,
        eps_clip_higher=high if high is not None else clip_ratio,
        c_clip=c,
        behav_imp_weight_cap=loss_config.behav_imp_weight_cap,
        behav_imp_weight_mode=loss_config.behav_imp_weight_mode,
    )
    loss.backward()
    return loss.detach(), theta.grad


CASES = [
    pytest.param(cap, clip, shape, id=f"{cap}-{clip}-{shape[0]}x{shape[1]}")
    for cap in CAPS
    for clip in CLIPS
    for shape in SHAPES
]


@pytest.mark.parametrize(("cap", "clip", "shape"), CASES)
@pytest.mark.parametrize("dp_size", [1, 2])
def test_recompute_loss_and_gradient_equal_verls_vanilla_with_token_is(cap, clip, shape, dp_size):
    prox, behav, theta, adv, mask = random_case(*shape)
    threshold = cap_threshold(CAPS[cap])
    weights, _ = verl_weights(prox, behav, mask, threshold)
    assert not weights.requires_grad  # verl detaches w (the measure, not the objective)
    verl_loss, verl_grad, _ = run_loss(
        compute_policy_loss_vanilla, prox, theta, adv, mask, weights, actor_config(CLIPS[clip]), dp_size
    )
    our_loss, our_grad, _ = run_loss(
        areal_decoupled_policy_loss, prox, theta, adv, mask, weights, actor_config(CLIPS[clip]), dp_size
    )
    torch.testing.assert_close(our_loss, verl_loss, **TOL)
    torch.testing.assert_close(our_grad, verl_grad, **TOL)
    # The pure oracle, from the behaviour log-probs (|log w| < 20 here, so verl's exp(±20) guard never binds).
    oracle_loss, oracle_grad = oracle(prox, behav, theta, adv, mask, CLIPS[clip], CAPS[cap])
    torch.testing.assert_close(oracle_loss, verl_loss, **TOL)
    torch.testing.assert_close(oracle_grad, verl_grad, **TOL)
    # Not vacuous: this case has real clipping, weights and padding to get right.
    assert verl_grad.abs().sum() > 0 and (verl_grad[~mask] == 0).all()


def test_the_random_cases_cross_every_bound():
    """The cases above would prove little if no token were clipped, dual-clipped, capped or padded."""
    prox, behav, theta, adv, mask = random_case(16, 33, 2)
    r, w = torch.exp(theta - prox)[mask], torch.exp(prox - behav)[mask]
    a = adv[mask]
    assert ((r > 1.2) & (a > 0)).any() and ((r < 0.8) & (a < 0)).any()  # both clip bounds bind
    assert ((r > 1.5) & (a < 0)).any()  # the dual clip c = 1.5 binds
    assert (w > 5).any() and (w > 1.5).sum() > 10 and (w < 1).any()  # each cap binds; weights below 1 too
    assert (~mask).any()


@pytest.mark.parametrize("cap", ["no cap", "mask 5 (recipes)", "mask 1.5", "clamp 1.5"])
@pytest.mark.parametrize("clip", list(CLIPS))
def test_loglinear_equals_verls_vanilla_with_theta_as_proximal(cap, clip):
    """``areal_decoupled_loglinear`` (bypass: verl hands it π_behav as ``old_log_prob``) against verl's vanilla loss
    given π_prox := sg(π_θ), with verl's weights of sg(log π_θ) - log π_behav."""
    _, behav, theta, adv, mask = random_case(16, 33, 3)
    threshold = cap_threshold(CAPS[cap])
    weights, _ = compute_rollout_correction_weights(theta - behav, mask.to(theta.dtype), "token", threshold)
    # verl's side: the proximal log-probs are θ's own, without gradient (one optimizer step per batch).
    verl_loss, verl_grad, _ = run_loss(
        compute_policy_loss_vanilla, theta, theta, adv, mask, weights, actor_config(CLIPS[clip]), 1
    )
    our_loss, our_grad, _ = run_loss(
        areal_decoupled_loglinear_policy_loss, behav, theta, adv, mask, None, actor_config(CLIPS[clip], threshold), 1
    )
    torch.testing.assert_close(our_loss, verl_loss, **TOL)
    torch.testing.assert_close(our_grad, verl_grad, **TOL)
    assert verl_grad.abs().sum() > 0


@pytest.mark.parametrize("cap", ["no cap", "mask 5 (recipes)", "clamp 1.5"])
def test_loglinear_has_the_gradient_of_verls_bypass_reinforce_but_not_its_value(cap):
    """verl's own bypass loss with ``loss_type=reinforce`` and token IS, -A sg(w) log π_θ, has our gradient
    (-A w d log π_θ at r = 1, where neither clip binds) but a different value: ours is -A w (r = 1), so verl's
    ``actor/pg_loss`` would change by the mean of -A w log π_θ."""
    _, behav, theta, adv, mask = random_case(16, 33, 4)
    threshold = cap_threshold(CAPS[cap])
    config = actor_config(CLIPS["symmetric 0.2, c 3 (recipes)"], threshold, bypass=True)
    verl_loss, verl_grad, _ = run_loss(compute_policy_loss_bypass_mode, behav, theta, adv, mask, None, config, 1)
    our_loss, our_grad, _ = run_loss(areal_decoupled_loglinear_policy_loss, behav, theta, adv, mask, None, config, 1)
    torch.testing.assert_close(our_grad, verl_grad, **TOL)
    weights, _ = compute_rollout_correction_weights(theta - behav, mask.to(theta.dtype), "token", threshold)
    torch.testing.assert_close(verl_loss - our_loss, ((-adv * weights * (theta - 1)) * mask).sum() / mask.sum(), **TOL)


# ---------------------------------------------------------------- where they differ


def verl_vanilla_metrics(prox, theta, adv, mask, weights, clips):
    config = actor_config(clips)
    return compute_policy_loss_vanilla(prox, theta, adv, mask, "token-mean", config, weights)


def hand_clip_counts(prox, theta, adv, clips):
    """Which tokens PPO's clip and the dual clip bind on, from the formula (docs/design.md, The decoupled objective)."""
    clip_ratio, low, high, c = clips
    r = torch.exp(theta - prox)
    unclipped, clipped = -adv * r, -adv * r.clamp(1 - (low or clip_ratio), 1 + (high or clip_ratio))
    pg = torch.maximum(unclipped, clipped)
    return clipped > unclipped, (adv < 0) & (pg > -c * adv)


def test_clip_fractions_agree_unless_the_cap_drops_tokens():
    """verl's ``actor/pg_clipfrac`` counts over every response token, dropped ones included; ours over the tokens the
    cap kept. Equal without drops (clamp), different with them (mask)."""
    clips = CLIPS["dual clip c 1.5"]
    prox, behav, theta, adv, mask = random_case(16, 33, 5)
    clipped, dual = hand_clip_counts(prox, theta, adv, clips)
    for cap, expect_equal in (("clamp 1.5", True), ("mask 1.5", False)):
        weights, _ = verl_weights(prox, behav, mask, cap_threshold(CAPS[cap]))
        kept = mask & (weights > 0)
        _, verls = verl_vanilla_metrics(prox, theta, adv, mask, weights, clips)
        _, ours = areal_decoupled_policy_loss(prox, theta, adv, mask, "token-mean", actor_config(clips), weights)
        # verl counts in float32 (``.float()``) and divides by count + 1e-8: equal to float32 rounding.
        assert verls["actor/pg_clipfrac"] == pytest.approx(float(clipped[mask].double().mean()), abs=1e-6)
        assert verls["actor/pg_clipfrac_lower"] == pytest.approx(float(dual[mask].double().mean()), abs=1e-6)
        assert ours["actor/pg_clipfrac"] == pytest.approx(float(clipped[kept].double().mean()), abs=1e-12)
        assert ours["actor/pg_clipfrac_lower"] == pytest.approx(float(dual[kept].double().mean()), abs=1e-12)
        same = math.isclose(ours["actor/pg_clipfrac"], verls["actor/pg_clipfrac"], abs_tol=1e-6)
        assert same is expect_equal, cap


def test_weight_statistics_verl_logs_under_other_names_and_meanings():
    """Our ``areal/behav_imp_weight_*`` against verl's ``rollout_corr/rollout_is_*`` (verl's ``compute_is_metrics``).

    - capped fraction: equal under mask; under clamp ours reads 0 (the weights arrive clamped, nothing is dropped)
      while verl counts the tokens its truncation bound.
    - mean: verl's is over every response token with the dropped ones as 0; ours over the kept tokens.
    - max: the largest weight applied, in both.
    """
    clips = CLIPS["symmetric 0.2, c 3 (recipes)"]
    prox, behav, theta, adv, mask = random_case(16, 33, 6)
    raw = torch.exp(prox - behav)[mask]
    for cap in ("mask 1.5", "clamp 1.5"):
        weights, verls = verl_weights(prox, behav, mask, cap_threshold(CAPS[cap]))
        _, ours = areal_decoupled_policy_loss(prox, theta, adv, mask, "token-mean", actor_config(clips), weights)
        above = float((raw > 1.5).double().mean())
        assert verls["rollout_corr/rollout_is_ratio_fraction_high"] == pytest.approx(above, abs=1e-6)
        assert ours["areal/behav_imp_weight_capped_frac"] == pytest.approx(above if cap.startswith("mask") else 0.0)
        applied = weights[mask]
        assert verls["rollout_corr/rollout_is_mean"] == pytest.approx(float(applied.mean()), abs=1e-9)
        assert ours["areal/behav_imp_weight_mean"] == pytest.approx(float(applied[applied > 0].mean()), rel=1e-12)
        assert ours["areal/behav_imp_weight_max"] == pytest.approx(verls["rollout_corr/rollout_is_max"], rel=1e-12)
    # What only ours reports (verl's loss returns actor/pg_clipfrac, actor/ppo_kl, actor/pg_clipfrac_lower).
    assert {"areal/approx_kl_prox_behav", "areal/nonfinite_frac", "areal/clip_frac"} <= set(ours)


def test_a_non_finite_token_poisons_verls_loss_not_ours():
    """A NaN log-prob inside the mask: verl's loss is NaN; ours drops the token and counts it."""
    clips = CLIPS["symmetric 0.2, c 3 (recipes)"]
    prox, behav, theta, adv, mask = random_case(4, 7, 7)
    weights, _ = verl_weights(prox, behav, mask, cap_threshold(CAPS["mask 5 (recipes)"]))
    theta[0, 0] = float("nan")
    verl_loss, _ = verl_vanilla_metrics(prox, theta, adv, mask, weights, clips)
    our_loss, ours = areal_decoupled_policy_loss(prox, theta, adv, mask, "token-mean", actor_config(clips), weights)
    assert torch.isnan(verl_loss) and torch.isfinite(our_loss)
    assert ours["areal/nonfinite_frac"] == pytest.approx(1 / int(mask.sum()))


def test_verls_exp_guard_on_the_weight_departs_from_the_oracle_only_beyond_e20():
    """Without a cap verl clamps log w to ±20 (``SAFETY_BOUND``) before exp; the oracle does not. ``areal_decoupled``
    takes verl's weights, so only the oracle departs, and only where w > e^20 ≈ 4.9e8."""
    clips = CLIPS["symmetric 0.2, c 3 (recipes)"]
    prox, behav, theta, adv, mask = random_case(4, 7, 8)
    behav[0, 0] = prox[0, 0] - 25.0
    weights, _ = verl_weights(prox, behav, mask, NO_CAP)
    assert float(weights[0, 0]) == pytest.approx(math.exp(20.0))
    verl_loss, verl_grad, _ = run_loss(
        compute_policy_loss_vanilla, prox, theta, adv, mask, weights, actor_config(clips), 1
    )
    our_loss, our_grad, _ = run_loss(
        areal_decoupled_policy_loss, prox, theta, adv, mask, weights, actor_config(clips), 1
    )
    torch.testing.assert_close(our_loss, verl_loss, **TOL)
    torch.testing.assert_close(our_grad, verl_grad, **TOL)
    oracle_loss, _ = oracle(prox, behav, theta, adv, mask, clips, CAPS["no cap"])
    assert not torch.isclose(oracle_loss, verl_loss)


def test_verls_ratio_guard_shows_only_below_e_minus_20():
    """verl clamps log r to ±20 before exp (``compute_policy_loss_vanilla``); ours does not. Beyond +20 PPO's clip or
    the dual clip binds in both, and below -20 with A < 0 the clip binds; only A > 0 with log r < -20 (unclipped)
    differs: verl's term is -A w e^-20 with no gradient, ours -A w r with gradient -A w r (both below 2.1e-9 A w)."""
    clips = CLIPS["symmetric 0.2, c 3 (recipes)"]
    prox, behav, theta, adv, mask = random_case(4, 7, 9)
    theta[0, :4] = prox[0, :4] + torch.tensor([25.0, 25.0, -25.0, -25.0], dtype=torch.float64)
    adv[0, :4] = torch.tensor([1.0, -1.0, -1.0, 1.0], dtype=torch.float64)
    weights, _ = verl_weights(prox, behav, mask, cap_threshold(CAPS["mask 5 (recipes)"]))
    (verl_loss, verl_grad, _), (our_loss, our_grad, _) = (
        run_loss(fn, prox, theta, adv, mask, weights, actor_config(clips), 1)
        for fn in (compute_policy_loss_vanilla, areal_decoupled_policy_loss)
    )
    tokens = int(mask.sum())
    w = float(weights[0, 3])
    torch.testing.assert_close(
        our_loss - verl_loss, torch.tensor(w * (math.exp(-20) - math.exp(-25)) / tokens, dtype=torch.float64), **TOL
    )
    assert (verl_grad[0, :4] == 0).all()  # clamped or clipped: no gradient through r
    torch.testing.assert_close(our_grad[0, 3], torch.tensor(-w * math.exp(-25) / tokens, dtype=torch.float64), **TOL)
    our_grad[0, 3] = 0.0
    torch.testing.assert_close(our_grad, verl_grad, **TOL)


@pytest.mark.parametrize("mode", ["token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_aggregations_other_than_the_token_mean_are_verls_only(mode):
    """The paper's objective is the global token mean; verl's other ``agg_loss`` modes are refused by ours."""
    clips = CLIPS["symmetric 0.2, c 3 (recipes)"]
    prox, behav, theta, adv, mask = random_case(4, 7, 10)
    weights, _ = verl_weights(prox, behav, mask, cap_threshold(CAPS["mask 5 (recipes)"]))
    config = actor_config(clips)
    verl_loss, _ = compute_policy_loss_vanilla(prox, theta, adv, mask, mode, config, weights)
    assert torch.isfinite(verl_loss)
    with pytest.raises(ValueError, match="loss_agg_mode=token-mean"):
        areal_decoupled_policy_loss(prox, theta, adv, mask, mode, config, weights)
    # agg_loss is the only difference: token-mean is the same aggregation in both.
    assert agg_loss(torch.ones_like(prox), mask, "token-mean") == pytest.approx(1.0)


def test_config_is_verls_own_dataclass():
    """The tests above build verl's ActorConfig, not a stand-in: a field we read that verl renamed fails here."""
    config = actor_config(CLIPS["asymmetric 0.2/0.28"])
    assert dataclasses.is_dataclass(config)
    assert (config.clip_ratio_low, config.clip_ratio_high, config.get("clip_ratio_c")) == (0.2, 0.28, 3.0)
