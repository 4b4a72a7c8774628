"""Length-ordered mini-batches for verl's padded micro-batches (docs/design.md, Micro-batches).

Without ``actor_rollout_ref.model.use_remove_padding`` verl pads every micro-batch to its longest
sequence, so one long response makes a whole micro-batch pay for its length in the proximal
log-prob pass and the actor update. Sorting each mini-batch by length (it keeps every sample in its
rank and mini-batch) cuts that padding; with padding removed, the order costs nothing and is kept.
"""

from __future__ import annotations

from typing import Any

from areal_plugins.core.microbatch import length_ordered, padded_tokens


def pads_micro_batches(config: Any) -> bool:
    """Whether verl pads the actor's micro-batches to their longest sequence under ``config``."""
    return not bool(config.actor_rollout_ref.model.get("use_remove_padding", False))


def order_batch_by_length(batch: Any, config: Any, dp_size: int, metrics: dict) -> Any:
    """Reorder a balanced ``KVBatchMeta`` in place: each rank's mini-batches longest first.

    Adds ``areal/padded_token_ratio`` (tokens the proximal log-prob pass computes per real token,
    with verl's fixed micro-batch size) and the ratio the batch would have had unordered.
    """
    lengths = [int(tag["seq_len"]) for tag in batch.tags]
    mini_batch = config.actor_rollout_ref.actor.ppo_mini_batch_size * config.actor_rollout_ref.rollout.n
    order = length_ordered(lengths, dp_size, mini_batch // dp_size if mini_batch % dp_size == 0 else None)
    micro = config.actor_rollout_ref.rollout.get("log_prob_micro_batch_size_per_gpu")
    if micro and not config.actor_rollout_ref.rollout.get("log_prob_use_dynamic_bsz", False):
        share = len(lengths) // dp_size

        def ratio(seq_lens: list[int]) -> float:  # each rank pads its own share
            padded = sum(padded_tokens(seq_lens[r * share : (r + 1) * share], micro) for r in range(dp_size))
            return padded / sum(seq_lens)

        metrics["areal/padded_token_ratio"] = ratio([lengths[i] for i in order])
        metrics["areal/padded_token_ratio_unordered"] = ratio(lengths)
    batch.reorder(order)
    return batch
