"""Router replay (R3) in the trainer: each token goes to the experts the rollout engine chose for it.

A mixture-of-experts policy routes a token by the top-k of its router's scores. The engine (other kernels, other
precision, other batch shapes) and the trainer can pick different experts for the same token, so the trainer's log-
probs of the sampled tokens are not the engine's, and the importance weights of the decoupled objective
(docs/design.md, The decoupled objective) stop meaning what they should. Replay removes that difference at its
source: the trainer's forward passes (the proximal/old log-prob pass and the update) use the **recorded** top-k
experts of each token, and the gate weights are recomputed from the trainer's **own** router logits at those
experts, so the router still receives gradients (what verl's Megatron router replay does,
``verl/utils/megatron/router_replay_patch.py``).

Layout: verl's batch carries ``routed_experts`` of shape (tokens, layers, k) per trajectory (vLLM's
``enable_return_routed_experts``; ``areal_cpu``'s recorder), row ``i`` the experts token ``i`` was routed to when it
was fed through the model. The last generated token is never fed, and rows the engine did not record are all zero:
for k >= 2 an all-zero row cannot be a route (the k experts of a route differ), so such rows route by the trainer's
own choice; for k = 1 every row is replayed (a zero row then names expert 0; the rows left unrecorded are the last
token and padding, whose outputs no loss reads).

The layer axis counts either every decoder layer (vLLM's capture buffer is indexed by absolute layer index) or the
mixture-of-experts layers only (as ``output_router_logits`` lists them); both are the same where every layer is one.

Runs in the trainer's worker processes (verl's FSDP engine; armed per micro-batch by
``patches/fsdp_router_replay.py``). Imports torch only.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

import torch

from areal_plugins.core.routing import RouterReplayError, find_routers, gate_weights


@dataclass
class ReplayCounts:
    """What the replay did since the last :meth:`RouterReplay.take_counts`: token-layer routes replayed, and of
    those, the ones where the trainer's own choice was another set of experts."""

    replayed: int = 0
    changed: int = 0


@dataclass
class RouterReplay:
    """Forward hooks on a model's routers that replace their choice with armed targets.

    :meth:`arm` gives the targets of the next forward pass (one micro-batch): (rows, layers, k), rows in the order
    the routers see them (the model's tokens flattened). They stay armed through the backward pass (activation
    checkpointing runs the routers again with the same rows) until the next :meth:`arm` or :meth:`disarm`.
    """

    routers: dict[int, torch.nn.Module]
    _slots: dict[int, int] = field(default_factory=dict)
    _targets: torch.Tensor | None = None
    _handles: list[Any] = field(default_factory=list)
    counts: ReplayCounts = field(default_factory=ReplayCounts)

    @classmethod
    def install(cls, model: torch.nn.Module) -> RouterReplay:
        replay = cls(find_routers(model))
        for layer, router in replay.routers.items():
            replay._handles.append(router.register_forward_hook(replay._hook(layer)))
        return replay

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def layer_slots(self, recorded_layers: int, num_layers: int) -> dict[int, int]:
        """Decoder layer index -> its slot on the targets' layer axis, for a record of ``recorded_layers`` slots."""
        if recorded_layers == num_layers:
            return {layer: layer for layer in self.routers}
        if recorded_layers == len(self.routers):
            return {layer: slot for slot, layer in enumerate(sorted(self.routers))}
        raise RouterReplayError(
            f"router replay: the recorded routes have {recorded_layers} layers; the trainer's model has "
            f"{num_layers} decoder layers of which {len(self.routers)} route to experts (the engine and the trainer "
            "must serve the same model; set actor_rollout_ref.rollout.enable_rollout_routing_replay=false otherwise)"
        )

    def arm(self, targets: torch.Tensor, num_layers: int) -> None:
        """Replay ``targets`` (rows, recorded layers, k) in the next forward pass."""
        if targets.dim() != 3:
            raise RouterReplayError(
                f"router replay: routes of shape {tuple(targets.shape)}, expected (rows, layers, k)"
            )
        top_k = {int(getattr(router, "top_k")) for router in self.routers.values()}  # noqa: B009 (typed Any)
        if top_k != {int(targets.shape[2])}:
            raise RouterReplayError(
                f"router replay: the recorded routes name {targets.shape[2]} experts a token, the trainer's routers "
                f"pick {sorted(top_k)} (num_experts_per_tok differs between engine and trainer)"
            )
        if targets.shape[2] > 1 and targets.numel() and not bool(targets.ne(0).any()):
            raise RouterReplayError(
                f"router replay: every one of the micro-batch's {targets.shape[0]} routes is empty (all zeros): the "
                "engine returned no routes, so nothing would be replayed; set "
                "actor_rollout_ref.rollout.enable_rollout_routing_replay=false or use an engine that records them"
            )
        self._slots = self.layer_slots(int(targets.shape[1]), num_layers)
        self._targets = targets.to(torch.int64)
        self.counts = ReplayCounts()

    def disarm(self) -> None:
        self._targets = None

    def take_counts(self) -> ReplayCounts:
        counts, self.counts = self.counts, ReplayCounts()
        return counts

    def _hook(self, layer: int) -> Any:
        def replace_choice(router: torch.nn.Module, _inputs: Any, output: Any) -> Any:
            if self._targets is None:
                return output
            return self._replayed(router, layer, output)

        return replace_choice

    def _replayed(self, router: torch.nn.Module, layer: int, output: Any) -> Any:
        logits, _scores, own = output
        assert self._targets is not None
        targets = self._targets[:, self._slots[layer], :].to(own.device)
        if targets.shape[0] != own.shape[0]:
            raise RouterReplayError(
                f"router replay: decoder layer {layer}'s router routes {own.shape[0]} tokens, the recorded routes "
                f"cover {targets.shape[0]} (the batch layout and the routes' layout differ)"
            )
        recorded = (
            targets.ne(0).any(dim=-1) if targets.shape[1] > 1 else torch.ones_like(targets[:, 0], dtype=torch.bool)
        )
        chosen = torch.where(recorded.unsqueeze(-1), targets, own)
        scores = gate_weights(router, logits, chosen)
        with torch.no_grad():
            same = chosen.sort(dim=-1).values.eq(own.sort(dim=-1).values).all(dim=-1)
            self.counts.replayed += int(recorded.sum())
            self.counts.changed += int((recorded & ~same).sum())
        return logits, scores, chosen


#: The replay this process armed last (set by patches/fsdp_router_replay.py); None where no route was replayed.
ARMED: RouterReplay | None = None


def replay_metrics() -> dict[str, float]:
    """The last armed micro-batch's replay, for the step's metrics (empty where this process replays nothing):
    routes replayed (token x layer) and the fraction of them where the trainer alone would have chosen other
    experts. Read by the policy loss right after the forward pass (before a checkpointed backward routes again)."""
    if ARMED is None:
        return {}
    counts = ARMED.take_counts()
    return {
        "areal/router_replay_routes": float(counts.replayed),
        "areal/router_replay_changed_fraction": counts.changed / counts.replayed if counts.replayed else 0.0,
    }


def packed_rows(routed: torch.Tensor, pad_rows: int = 0) -> torch.Tensor:
    """Routes of a micro-batch of sequences packed into one row (padding removed), in the routers' order:
    ``routed`` (nested, jagged: per sequence (tokens, layers, k)) flattened, then ``pad_rows`` zero rows (the
    engine's pad suffix, routed by the trainer's own choice)."""
    rows = routed.values() if routed.is_nested else routed.flatten(0, 1)
    if pad_rows:
        rows = torch.cat([rows, rows.new_zeros((pad_rows, *rows.shape[1:]))])
    return rows


def padded_rows(routed: torch.Tensor, max_len: int) -> torch.Tensor:
    """Routes of a micro-batch of right-padded sequences (batch, ``max_len``), in the routers' order (row-major):
    each sequence's rows, then zero rows to ``max_len``."""
    offsets = routed.offsets().tolist()  # type: ignore[attr-defined]  # a nested jagged tensor
    values = routed.values()
    out = values.new_zeros((len(offsets) - 1, max_len, *values.shape[1:]))
    for index, (start, end) in enumerate(itertools.pairwise(offsets)):
        out[index, : end - start] = values[start:end]
    return out.flatten(0, 1)
