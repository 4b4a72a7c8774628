"""M2PO's mask and loss against values worked out by hand from the paper's Algorithm 1 and Eq. 5."""

from __future__ import annotations

import math

import pytest
import torch

from areal_plugins.objectives.m2po import m2po_loss, m2po_mask


def test_the_largest_second_moments_of_the_trust_region_go_until_the_mean_is_at_most_tau():
    # log r = 0.1, 0.3, 0.5, -0.4 with A = +1, +1, +1, -1: all four are in the trust region.
    # M2 = 0.01, 0.09, 0.25, 0.16; mean 0.1275 > 0.04 -> drop 0.25: mean(0.01, 0.09, 0.16) = 0.0867
    # -> drop 0.16: mean(0.01, 0.09) = 0.05 -> drop 0.09: mean 0.01 <= 0.04. Only token 0 is kept.
    log_ratio = torch.tensor([[0.1, 0.3, 0.5, -0.4]])
    advantages = torch.tensor([[1.0, 1.0, 1.0, -1.0]])
    dropped = m2po_mask(log_ratio, advantages, torch.ones(1, 4, dtype=torch.bool), tau=0.04)
    assert dropped.tolist() == [[False, True, True, True]]


def test_tokens_outside_the_trust_region_are_never_dropped():
    # A > 0 with r < 1 and A < 0 with r > 1: PPO would not clip these; M2 of 4.0 does not matter.
    log_ratio = torch.tensor([[-2.0, 2.0, 0.1]])
    advantages = torch.tensor([[1.0, -1.0, 1.0]])
    dropped = m2po_mask(log_ratio, advantages, torch.ones(1, 3, dtype=torch.bool), tau=0.04)
    assert dropped.tolist() == [[False, False, False]]  # T = {token 2}, mean 0.01 <= 0.04


def test_a_tau_above_the_mean_drops_nothing_and_ties_are_dropped_one_at_a_time():
    log_ratio = torch.tensor([[0.3, 0.3, 0.3, 0.1]])  # M2 = 0.09, 0.09, 0.09, 0.01
    advantages = torch.ones(1, 4)
    valid = torch.ones(1, 4, dtype=torch.bool)
    assert not m2po_mask(log_ratio, advantages, valid, tau=0.07).any()  # mean 0.07
    # tau 0.05: drop one 0.09 -> mean(0.09, 0.09, 0.01) = 0.0633; drop another -> 0.05 <= 0.05: two go.
    assert int(m2po_mask(log_ratio, advantages, valid, tau=0.05).sum()) == 2


def test_loss_is_the_kept_ratio_times_advantage_over_every_token_with_its_gradient():
    behav = torch.zeros(1, 4)
    logp = torch.tensor([[0.1, 0.3, 0.5, -0.4]], requires_grad=True)  # log r = logp - behav
    advantages = torch.tensor([[1.0, 1.0, 1.0, -1.0]])
    mask = torch.ones(1, 4)
    loss, stats = m2po_loss(logp, logp.detach(), behav, advantages, mask, eps_clip=0.2)
    # Only token 0 kept (first test): loss = -(e^0.1 * 1) / 4 tokens.
    assert loss.item() == pytest.approx(-math.exp(0.1) / 4)
    loss.backward()
    assert logp.grad is not None
    assert logp.grad.tolist()[0] == pytest.approx([-math.exp(0.1) / 4, 0.0, 0.0, 0.0])
    assert stats["m2po_masked_frac"] == pytest.approx(3 / 4)
    assert stats["m2po_m2"] == pytest.approx((0.01 + 0.09 + 0.25 + 0.16) / 4)
    assert stats["m2po_m2_kept"] == pytest.approx(0.01)


def test_padding_counts_nowhere_and_non_finite_tokens_are_dropped():
    logp = torch.tensor([[0.0, float("nan"), 0.0]], requires_grad=True)
    behav = torch.zeros(1, 3)
    advantages = torch.tensor([[2.0, 1.0, 5.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])  # token 2 is padding
    loss, stats = m2po_loss(logp, logp.detach(), behav, advantages, mask)
    # Token 0: r = 1, not in T (r = 1 is neither > 1 nor < 1), kept: -(1 * 2) / 2 tokens in the mask.
    assert loss.item() == pytest.approx(-1.0)
    assert stats["nonfinite_frac"] == pytest.approx(0.5)
