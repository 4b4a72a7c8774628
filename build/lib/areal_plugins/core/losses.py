"""The decoupled PPO objective (AReaL, arXiv 2505.24298 §5.2, Eq. 5; docs/design.md, The decoupled objective).

Three policies: behaviour ``π_behav`` (the engine's log-probs, per token, possibly of several
versions), proximal ``π_prox`` (the trainer's weights before this step's update) and ``π_θ``::

    r_t  = exp(logp_θ - logp_prox)          # the clip is centred on the proximal policy
    w_t  = exp(logp_prox - logp_behav)      # behaviour importance weight (no gradient)
    pg_t = max(-A_t r_t, -A_t clip(r_t, 1 - ε_low, 1 + ε_high))
    dual clip (c > 1): for A_t < 0, pg_t = min(pg_t, -c A_t)
    cap: "mask" drops tokens with w_t > cap from the numerator; "clamp" uses min(w_t, cap)
    loss = Σ_t mask_t w_t pg_t / Σ_t mask_t  # the denominator counts tokens before any cap drop

With ``π_behav = π_prox`` it is standard clipped PPO. Pure torch: no Ray, no verl.
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)

WEIGHT_MODES = ("mask", "clamp")


def decoupled_ppo_loss(
    logprobs: torch.Tensor,
    proximal_logprobs: torch.Tensor,
    behav_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    eps_clip: float = 0.2,
    eps_clip_higher: float | None = None,
    c_clip: float | None = None,
    behav_imp_weight_cap: float | None = None,
    behav_imp_weight_mode: str = "mask",
) -> tuple[torch.Tensor, dict[str, float]]:
    """Return the token-mean decoupled PPO loss over ``loss_mask`` and its statistics.

    Args:
        logprobs: log π_θ per token, (batch, response_len); the only input that carries gradient.
        proximal_logprobs: log π_prox per token, same shape.
        behav_logprobs: log π_behav per token (from the rollout engine), same shape.
        advantages: A_t, same shape.
        loss_mask: 1 for response tokens that count, 0 otherwise (bool or float).
        eps_clip: ε_low (and ε_high unless ``eps_clip_higher`` is given).
        eps_clip_higher: ε_high for asymmetric clipping.
        c_clip: dual-clip constant c > 1, or None for no dual clip.
        behav_imp_weight_cap: cap > 1 on w_t, or None for no cap.
        behav_imp_weight_mode: ``"mask"`` (drop tokens above the cap) or ``"clamp"``.

    Returns:
        ``(loss, stats)``: a scalar tensor and floats ``behav_imp_weight_mean``/``_max`` (before the
        cap), ``behav_imp_weight_capped_frac``, ``clip_frac``, ``dual_clip_frac``,
        ``approx_kl_prox_behav`` (KL(π_prox‖π_behav) estimated from behaviour samples as
        E[w (log π_prox - log π_behav)]), ``nonfinite_frac`` and ``num_tokens``.

    Tokens of the mask whose log-probs or advantage are not finite are dropped from the numerator
    (still counted in the denominator) and reported in ``nonfinite_frac``: the loss stays finite.
    """
    shape = logprobs.shape
    for name, tensor in (
        ("proximal_logprobs", proximal_logprobs),
        ("behav_logprobs", behav_logprobs),
        ("advantages", advantages),
        ("loss_mask", loss_mask),
    ):
        if tensor.shape != shape:
            raise ValueError(f"{name} has shape {tuple(tensor.shape)}, logprobs has {tuple(shape)}; they must match")
    if c_clip is not None and c_clip <= 1:
        raise ValueError(f"c_clip must be > 1 (dual clip), got {c_clip}; use None to disable it")
    if behav_imp_weight_cap is not None and behav_imp_weight_cap <= 1:
        raise ValueError(f"behav_imp_weight_cap must be > 1, got {behav_imp_weight_cap}; use None to disable it")
    if behav_imp_weight_mode not in WEIGHT_MODES:
        raise ValueError(f"behav_imp_weight_mode must be one of {WEIGHT_MODES}, got {behav_imp_weight_mode!r}")
    eps_high = eps_clip if eps_clip_higher is None else eps_clip_higher

    mask = loss_mask.to(torch.bool)
    finite = torch.isfinite(logprobs) & torch.isfinite(proximal_logprobs) & torch.isfinite(behav_logprobs)
    finite &= torch.isfinite(advantages)
    valid = mask & finite
    num_tokens = mask.sum()
    denominator = num_tokens.clamp(min=1).to(logprobs.dtype)

    # Zero the invalid entries before any exp(): a NaN there would poison the gradient via where().
    zero = torch.zeros_like(logprobs)
    logp = torch.where(valid, logprobs, zero)
    prox = torch.where(valid, proximal_logprobs, zero).detach()
    behav = torch.where(valid, behav_logprobs, zero).detach()
    adv = torch.where(valid, advantages, zero).detach()

    ratio = torch.exp(logp - prox)
    clipped_ratio = ratio.clamp(1.0 - eps_clip, 1.0 + eps_high)
    unclipped_loss, clipped_loss = -adv * ratio, -adv * clipped_ratio
    pg = torch.maximum(unclipped_loss, clipped_loss)
    clipped = clipped_loss > unclipped_loss
    dual_clipped = torch.zeros_like(valid)
    if c_clip is not None:
        dual_bound = -c_clip * adv
        dual_clipped = (adv < 0) & (pg > dual_bound)
        pg = torch.where(dual_clipped, dual_bound, pg)

    weight = torch.exp(prox - behav)
    capped = torch.zeros_like(valid)
    effective_weight = weight
    if behav_imp_weight_cap is not None:
        capped = weight > behav_imp_weight_cap
        if behav_imp_weight_mode == "mask":
            effective_weight = torch.where(capped, torch.zeros_like(weight), weight)
        else:
            effective_weight = weight.clamp(max=behav_imp_weight_cap)

    loss = torch.where(valid, effective_weight * pg, zero).sum() / denominator

    with torch.no_grad():
        count = max(int(num_tokens), 1)
        valid_count = max(int(valid.sum()), 1)
        nonfinite = int((mask & ~finite).sum())
        if nonfinite:
            logger.warning("decoupled_ppo_loss: dropped %d token(s) with non-finite inputs", nonfinite)
        valid_weights = weight[valid]
        stats = {
            "behav_imp_weight_mean": float(valid_weights.mean()) if valid_weights.numel() else 1.0,
            "behav_imp_weight_max": float(valid_weights.max()) if valid_weights.numel() else 1.0,
            "behav_imp_weight_capped_frac": float((capped & valid).sum()) / valid_count,
            "clip_frac": float((clipped & valid).sum()) / valid_count,
            "dual_clip_frac": float((dual_clipped & valid).sum()) / valid_count,
            "approx_kl_prox_behav": float((weight * (prox - behav))[valid].sum()) / valid_count,
            "nonfinite_frac": nonfinite / count,
            "num_tokens": float(num_tokens),
        }
    return loss, stats
