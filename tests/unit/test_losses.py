"""decoupled_ppo_loss against hand-derived values, an independent PPO reference and gradient checks."""

from __future__ import annotations

import math

import pytest
import torch

from areal_plugins.core.losses import decoupled_ppo_loss

LOG = math.log


def t(*values):
    return torch.tensor([list(values)], dtype=torch.float64)


def test_hand_derived_single_tokens():
    # Token 1: r = 1.5, w = 2, A = +1 -> max(-1.5, -1.2) = -1.2, weighted -2.4 (clipped).
    # Token 2: r = 0.5, w = 1, A = -1 -> max(0.5, 0.8) = 0.8 (clipped).
    loss, stats = decoupled_ppo_loss(
        logprobs=t(LOG(1.5), LOG(0.5)),
        proximal_logprobs=t(0.0, 0.0),
        behav_logprobs=t(LOG(0.5), 0.0),
        advantages=t(1.0, -1.0),
        loss_mask=t(1.0, 1.0),
    )
    assert float(loss) == pytest.approx((-2.4 + 0.8) / 2)
    assert stats["clip_frac"] == 1.0
    assert stats["behav_imp_weight_mean"] == pytest.approx(1.5)
    assert stats["behav_imp_weight_max"] == pytest.approx(2.0)
    # KL(prox||behav) estimate: mean of w * (prox - behav) = (2 * log 2 + 0) / 2.
    assert stats["approx_kl_prox_behav"] == pytest.approx(LOG(2.0))


def test_dual_clip_bounds_negative_advantages():
    # r = 4, A = -1: pg = max(4, 1.2) = 4; with c = 3 the dual clip caps it at 3.
    args = (t(LOG(4.0)), t(0.0), t(0.0), t(-1.0), t(1.0))
    assert float(decoupled_ppo_loss(*args)[0]) == pytest.approx(4.0)
    loss, stats = decoupled_ppo_loss(*args, c_clip=3.0)
    assert float(loss) == pytest.approx(3.0)
    assert stats["dual_clip_frac"] == 1.0


def test_asymmetric_clip_uses_eps_high_above_one():
    # r = 1.5, A = +1: ε_high = 0.28 -> max(-1.5, -1.28) = -1.28.
    loss, _ = decoupled_ppo_loss(t(LOG(1.5)), t(0.0), t(0.0), t(1.0), t(1.0), eps_clip_higher=0.28)
    assert float(loss) == pytest.approx(-1.28)


def test_cap_mask_drops_from_numerator_not_denominator():
    # Token 1 as above (-2.4); token 2 has w = 6 > cap 5: dropped, yet counted -> (-2.4 + 0) / 2.
    common = dict(logprobs=t(LOG(1.5), 0.0), proximal_logprobs=t(0.0, 0.0), advantages=t(1.0, 1.0))
    loss, stats = decoupled_ppo_loss(
        **common, behav_logprobs=t(LOG(0.5), LOG(1 / 6)), loss_mask=t(1.0, 1.0), behav_imp_weight_cap=5.0
    )
    assert float(loss) == pytest.approx(-1.2)
    assert stats["behav_imp_weight_capped_frac"] == 0.5
    # clamp: w = 5 for token 2, r = 1 -> pg = -1 -> (-2.4 - 5) / 2.
    loss, _ = decoupled_ppo_loss(
        **common,
        behav_logprobs=t(LOG(0.5), LOG(1 / 6)),
        loss_mask=t(1.0, 1.0),
        behav_imp_weight_cap=5.0,
        behav_imp_weight_mode="clamp",
    )
    assert float(loss) == pytest.approx((-2.4 - 5.0) / 2)


def test_mask_excludes_tokens_and_accepts_bool():
    loss, stats = decoupled_ppo_loss(
        t(LOG(1.5), 9.0), t(0.0, 0.0), t(LOG(0.5), -9.0), t(1.0, 100.0), torch.tensor([[True, False]])
    )
    assert float(loss) == pytest.approx(-2.4)
    assert stats["num_tokens"] == 1


def test_equals_standard_ppo_when_behaviour_is_proximal():
    torch.manual_seed(0)
    logp = torch.randn(4, 7, dtype=torch.float64) * 0.3 - 1
    old = logp + torch.randn(4, 7, dtype=torch.float64) * 0.2
    adv = torch.randn(4, 7, dtype=torch.float64)
    mask = (torch.rand(4, 7) > 0.3).double()
    # Independent reference: clipped PPO, token mean over the mask.
    ratio = torch.exp(logp - old)
    reference = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.2))
    reference = (reference * mask).sum() / mask.sum()
    loss, stats = decoupled_ppo_loss(logp, old, old, adv, mask)
    torch.testing.assert_close(loss, reference)
    assert stats["behav_imp_weight_max"] == pytest.approx(1.0)


def test_gradients():
    torch.manual_seed(1)
    prox = torch.randn(2, 5, dtype=torch.float64) * 0.1 - 1
    behav = prox + torch.randn(2, 5, dtype=torch.float64) * 0.1
    adv = torch.randn(2, 5, dtype=torch.float64)
    mask = torch.ones(2, 5, dtype=torch.float64)
    logp = (prox + torch.randn(2, 5, dtype=torch.float64) * 0.05).requires_grad_()

    def fn(x):
        return decoupled_ppo_loss(x, prox, behav, adv, mask, c_clip=3.0, behav_imp_weight_cap=5.0)[0]

    assert torch.autograd.gradcheck(fn, (logp,))
    # Analytic: an unclipped token's gradient is -A r w / N.
    fn(logp).backward()
    ratio, weight = torch.exp(logp - prox), torch.exp(prox - behav)
    inside = (ratio > 0.8) & (ratio < 1.2)
    expected = (-adv * ratio * weight / mask.sum()).detach()
    torch.testing.assert_close(logp.grad[inside], expected[inside])


def test_nonfinite_inputs_never_give_nan():
    logp = t(LOG(1.5), float("nan"), 0.0).requires_grad_()
    loss, stats = decoupled_ppo_loss(
        logp, t(0.0, 0.0, float("-inf")), t(LOG(0.5), 0.0, 0.0), t(1.0, 1.0, 1.0), t(1, 1, 1)
    )
    assert float(loss.detach()) == pytest.approx(-2.4 / 3)
    assert stats["nonfinite_frac"] == pytest.approx(2 / 3)
    loss.backward()
    assert torch.isfinite(logp.grad).all()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"c_clip": 1.0}, "c_clip must be > 1"),
        ({"behav_imp_weight_cap": 0.5}, "behav_imp_weight_cap must be > 1"),
        ({"behav_imp_weight_mode": "clip"}, "behav_imp_weight_mode must be one of"),
    ],
)
def test_bad_settings(kwargs, message):
    x = t(0.0)
    with pytest.raises(ValueError, match=message):
        decoupled_ppo_loss(x, x, x, x, x, **kwargs)


def test_shape_mismatch():
    with pytest.raises(ValueError, match="behav_logprobs has shape"):
        decoupled_ppo_loss(t(0.0, 0.0), t(0.0, 0.0), t(0.0), t(0.0, 0.0), t(1.0, 1.0))
