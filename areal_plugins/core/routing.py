"""Mixture-of-experts routing, as transformers' models compute it: where the routers are, and the gate weights of a
set of chosen experts by a router's own formula. Shared by router replay in the trainer
(trainer_workers/router_replay.py, docs/design.md, Router replay) and the tests' biased engine (testing/router_bias.py).
Imports torch only.
"""

from __future__ import annotations

import torch

#: Router classes whose choice is top-k of softmax(logits), with the chosen weights renormalised when the module's
#: ``norm_topk_prob`` is set (transformers 5: ``Qwen2MoeTopKRouter.forward``, ``Qwen3MoeTopKRouter.forward``).
SOFTMAX_TOPK_ROUTERS = ("Qwen2MoeTopKRouter", "Qwen3MoeTopKRouter")


class RouterReplayError(RuntimeError):
    """The recorded routes cannot be replayed into this model (what was expected, what was found, what to change)."""


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's decoder layers in order (transformers' ``model.layers``), found through any wrapper."""
    for name, module in model.named_modules():
        if name.endswith("layers") and isinstance(module, torch.nn.ModuleList) and len(module) > 0:
            return list(module)
    raise RouterReplayError("router replay: the model has no decoder layer list (a ModuleList named 'layers')")


def find_routers(model: torch.nn.Module) -> dict[int, torch.nn.Module]:
    """Each decoder layer's index -> its router, for the layers that have one; refuses a router it cannot replay."""
    routers: dict[int, torch.nn.Module] = {}
    for index, layer in enumerate(decoder_layers(model)):
        for module in layer.modules():
            kind = type(module).__name__
            if kind.endswith("Router") or kind.endswith("TopKRouter"):
                if kind not in SOFTMAX_TOPK_ROUTERS:
                    raise RouterReplayError(
                        f"router replay: decoder layer {index} routes with {kind}, which this replay does not know "
                        f"(known: {', '.join(SOFTMAX_TOPK_ROUTERS)}); set "
                        "actor_rollout_ref.rollout.enable_rollout_routing_replay=false for this model"
                    )
                routers[index] = module
    if not routers:
        raise RouterReplayError(
            "router replay: the model has no mixture-of-experts router; set "
            "actor_rollout_ref.rollout.enable_rollout_routing_replay=false (it applies to MoE models only)"
        )
    return routers


def gate_weights(router: torch.nn.Module, logits: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """The gate weights of the ``chosen`` experts (rows, k) from ``logits`` (rows, experts), by the router's own
    formula: softmax over every expert in float32, read at the chosen ones, renormalised where the router's
    ``norm_topk_prob`` says so, in the logits' dtype."""
    scores = torch.softmax(logits, dim=-1, dtype=torch.float).gather(-1, chosen)
    if getattr(router, "norm_topk_prob", False):
        scores = scores / scores.sum(dim=-1, keepdim=True)
    return scores.to(logits.dtype)
