"""A mixture-of-experts update in the checkpoint's names, loaded into transformers' fused expert parameters.

verl's FSDP trainer sends a Qwen2-MoE's experts as the checkpoint names them, one tensor per expert and projection
(``mlp.experts.<j>.gate_proj.weight``, ``up_proj``, ``down_proj``), while transformers 5 holds each layer's experts
fused: ``mlp.experts.gate_up_proj`` of shape (experts, 2 x intermediate, hidden), expert ``j``'s gate rows then its up
rows, and ``mlp.experts.down_proj`` of shape (experts, hidden, intermediate). This is the same layout transformers'
own checkpoint loading builds (``from_pretrained`` of the saved per-expert files; ``tests/unit/test_moe_fused_load.py``
holds the two against each other). A layer whose experts arrive only in part is refused naming what is missing: a
fused parameter cannot be written expert by expert from a partial update without silently keeping old weights.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch

_PER_EXPERT = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")


def fuse_expert_tensors(state_dict: dict[str, torch.Tensor], model_names: Iterable[str]) -> dict[str, torch.Tensor]:
    """``state_dict`` with per-expert tensors replaced by the fused parameters the model has (others unchanged)."""
    fused_prefixes = {name[: -len(".gate_up_proj")] for name in model_names if name.endswith(".experts.gate_up_proj")}
    if not fused_prefixes:
        return state_dict
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for name, tensor in state_dict.items():
        match = _PER_EXPERT.match(name)
        if match is None or match["prefix"] not in fused_prefixes:
            out[name] = tensor
            continue
        experts.setdefault(match["prefix"], {}).setdefault(int(match["expert"]), {})[match["proj"]] = tensor
    for prefix, by_expert in experts.items():
        count = max(by_expert) + 1
        missing = [
            f"{prefix}.{j}.{proj}.weight"
            for j in range(count)
            for proj in ("gate_proj", "up_proj", "down_proj")
            if proj not in by_expert.get(j, {})
        ]
        if missing:
            raise RuntimeError(
                f"weight update carries part of {prefix}: missing {missing[:5]} (a fused expert parameter is loaded "
                "whole, from every expert's gate, up and down projections)"
            )
        out[f"{prefix}.gate_up_proj"] = torch.stack(
            [torch.cat([by_expert[j]["gate_proj"], by_expert[j]["up_proj"]], 0) for j in range(count)]
        )
        out[f"{prefix}.down_proj"] = torch.stack([by_expert[j]["down_proj"] for j in range(count)])
    return out


def held_tensor(served: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """What the model holds under a sent ``name``: the model's own tensor, or one expert's projection read back out
    of the fused parameter (the per-update check compares it with what the trainer sent)."""
    if name in served:
        return served[name]
    match = _PER_EXPERT.match(name)
    if match is None or f"{match['prefix']}.gate_up_proj" not in served:
        raise KeyError(name)
    expert = int(match["expert"])
    if match["proj"] == "down_proj":
        return served[f"{match['prefix']}.down_proj"][expert]
    gate_up = served[f"{match['prefix']}.gate_up_proj"][expert]
    half = gate_up.shape[0] // 2
    return gate_up[:half] if match["proj"] == "gate_proj" else gate_up[half:]
