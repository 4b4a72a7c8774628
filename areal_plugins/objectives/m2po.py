"""M2PO, second-moment trust policy optimization (Zheng et al. 2025, arXiv 2510.01161, §5.2 and Algorithm 1).

Instead of clipping the ratio, M2PO masks the tokens that make the batch's importance weights
heavy-tailed::

    r_t   = π_θ(a_t) / π_behav(a_t)               # against the behaviour policy, no proximal policy
    M2_t  = (log r_t)²                             # computed without gradient
    trust region T = {t : A_t > 0 and r_t > 1} ∪ {t : A_t < 0 and r_t < 1}   # where PPO would clip
    mask: drop the tokens of T with the largest M2_t until mean_{T kept} M2 ≤ τ (τ = 0.04)
    loss  = -Σ_t kept_t r_t A_t / Σ_t mask_t      # denominator: every token (the paper's choice)

Tokens outside T are never dropped. Dropping the largest first until the mean is at most τ keeps the
``j`` smallest values of T for the largest ``j`` whose mean is ≤ τ (the mean of the ``j`` smallest
grows with ``j``), which is how it is computed here, in one sort.

This loss sees one micro-batch at a time, so the mask bounds each micro-batch's second moment, not
the whole batch's as in the paper. ``eps_clip`` and the other PPO arguments are accepted and
ignored: M2PO has no clip. Enable with ``areal.plugins.include: [m2po]`` (docs/objectives.md).
"""

from __future__ import annotations

from typing import Any

import torch

from areal_plugins.hooks.hookimpl import hookimpl

#: Loaded only when named in ``areal.plugins.include`` (areal_plugins.plugin_manager).
AREAL_PLUGIN_OPT_IN = True
#: τ of the paper ("a single setting of 0.04 works robustly across all training settings").
M2_THRESHOLD = 0.04


def m2po_mask(log_ratio: torch.Tensor, advantages: torch.Tensor, valid: torch.Tensor, tau: float) -> torch.Tensor:
    """Boolean mask of the tokens M2PO drops (a subset of the trust region of ``valid`` tokens)."""
    trust = valid & (((advantages > 0) & (log_ratio > 0)) | ((advantages < 0) & (log_ratio < 0)))
    values = log_ratio.detach()[trust] ** 2
    dropped = torch.zeros_like(valid)
    if values.numel() == 0:
        return dropped
    ascending, order = torch.sort(values)
    means = torch.cumsum(ascending, 0) / torch.arange(
        1, values.numel() + 1, dtype=ascending.dtype, device=values.device
    )
    keep = int((means <= tau).sum())
    dropped_in_trust = torch.ones(values.numel(), dtype=torch.bool, device=values.device)
    dropped_in_trust[order[:keep]] = False
    dropped[trust] = dropped_in_trust
    return dropped


def m2po_loss(
    logprobs: torch.Tensor,
    proximal_logprobs: torch.Tensor,
    behav_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    tau: float = M2_THRESHOLD,
    **_ppo_arguments: Any,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The M2PO loss over ``loss_mask`` (token mean) and its statistics; same call as ``decoupled_ppo_loss``."""
    mask = loss_mask.to(torch.bool)
    valid = mask & torch.isfinite(logprobs) & torch.isfinite(behav_logprobs) & torch.isfinite(advantages)
    zero = torch.zeros_like(logprobs)
    logp = torch.where(valid, logprobs, zero)
    behav = torch.where(valid, behav_logprobs, zero).detach()
    adv = torch.where(valid, advantages, zero).detach()
    log_ratio = logp - behav
    dropped = m2po_mask(log_ratio, adv, valid, tau)
    kept = valid & ~dropped
    denominator = mask.sum().clamp(min=1).to(logprobs.dtype)
    loss = -torch.where(kept, torch.exp(log_ratio) * adv, zero).sum() / denominator
    with torch.no_grad():
        count = max(int(mask.sum()), 1)
        m2 = log_ratio**2
        prox = torch.where(valid, proximal_logprobs, zero)
        weight = torch.exp(prox - behav)
        stats = {
            "m2po_m2": float(m2[valid].mean()) if bool(valid.any()) else 0.0,
            "m2po_m2_kept": float(m2[kept].mean()) if bool(kept.any()) else 0.0,  # all kept, not only T
            "m2po_masked_frac": float(dropped.sum()) / count,
            "clip_frac": float(dropped.sum()) / count,  # what M2PO does instead of clipping
            "dual_clip_frac": 0.0,
            "approx_kl_prox_behav": float((weight * (prox - behav))[valid].sum()) / count,
            "behav_imp_weight_max": float(weight[valid].max()) if bool(valid.any()) else 1.0,
            "nonfinite_frac": float((mask & ~valid).sum()) / count,
            "num_tokens": float(mask.sum()),
        }
    return loss, stats


@hookimpl
def areal_make_policy_loss() -> Any:
    return m2po_loss
