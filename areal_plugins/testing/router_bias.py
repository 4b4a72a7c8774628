"""For tests: an engine whose routers choose other experts than the trainer's would, by construction.

Router replay (R3) matters where the engine and the trainer route a token differently (other kernels, other
precision). On one CPU both compute the same, so a test makes the difference: the engine's routers add ``bias`` to
expert ``expert``'s logit **for the choice only** (the returned logits, which the engine's route recorder reads,
carry it; the gate weights are computed from the unbiased logits, as the trainer computes them). Every route the
bias flips is then a route the trainer takes differently without replay, and identically with it.

``areal_cpu``'s engine option ``test_router_choice_bias: [expert, bias]``
(``actor_rollout_ref.rollout.engine_kwargs.areal_cpu``) installs it (rollout/cpu/server.py).
"""

from __future__ import annotations

from typing import Any

import torch

from areal_plugins.core.routing import find_routers, gate_weights


def install_router_choice_bias(model: torch.nn.Module, expert: int, bias: float) -> list[Any]:
    """Bias every router of ``model`` towards ``expert`` by ``bias`` (logits) in its choice; the hook handles."""
    handles = []
    for router in find_routers(model).values():
        experts = int(getattr(router, "num_experts"))  # noqa: B009 (a module attribute, typed Any)
        if not 0 <= expert < experts:
            raise ValueError(f"test_router_choice_bias: expert {expert} is not one of the router's {experts}")

        def biased_choice(module: torch.nn.Module, _inputs: Any, output: Any) -> Any:
            logits, _scores, own = output
            shifted = logits.clone()
            shifted[:, expert] += bias
            chosen = torch.topk(shifted, own.shape[-1], dim=-1).indices
            return shifted, gate_weights(module, logits, chosen), chosen

        handles.append(router.register_forward_hook(biased_choice))
    return handles
