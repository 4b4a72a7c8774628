"""Patch: verl's token-budget micro-batches packed by AReaL's FFD (``areal.micro_batch.max_tokens``).

*Why*: with ``use_dynamic_bsz`` verl derives the micro-batch *count* from the token budget and
balances Σ seqlen² across that count (Karmarkar-Karp); the paper packs with first-fit-decreasing
(:func:`areal_plugins.core.microbatch.ffd_allocate`). Both count real tokens, which is what a
padding-free engine computes; where verl pads each micro-batch to its longest sequence
(``use_remove_padding: false``) both mix long and short sequences, so the patch then cuts runs of
like length within the budget counted *padded* (:func:`areal_plugins.core.microbatch.padded_allocate`).
verl 0.9.1 has no seam for the partitioner: the engine calls ``rearrange_micro_batches``, imported by
name into ``verl.workers.engine.utils``.
*What stays verl's*: the token budget (``ppo_max_token_len_per_gpu``, routed from our setting), the
loss normalisation (the engine counts the global batch's tokens before it splits, so the global
token mean does not depend on the partition) and the restore of the original order (from the index
lists returned here).
*Upstream*: no seam in verl 0.9.1. *Remove when*: verl lets the engine config name a
partitioner; no upstream issue yet: watch ``verl/workers/engine/utils.py`` (``rearrange_micro_batches``, replaced
whole here; verl PRs #7553, merged, and #6735, open, change how verl partitions).

The trainer applies it inside the actor worker processes
(:func:`areal_plugins.driver.worker_calls.apply_patches_in_workers`).
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any

from areal_plugins.patches._base import AttributePatch

from areal_plugins._compat import SUPPORTED_VERL
from areal_plugins.core.microbatch import ffd_allocate, padded_allocate

#: The packing per engine mode: FFD where verl removes padding, runs of like length where it pads.
ALLOCATORS = {"ffd": ffd_allocate, "padded_runs": padded_allocate}

logger = logging.getLogger(__name__)

TARGETS = (("verl.workers.engine.utils", "rearrange_micro_batches"),)
#: One line per partition, when ``$AREAL_RUN_DIR`` is set: what was packed and how full.
LOG_NAME = "micro_batches.jsonl"


def sequence_lengths(batch: Any) -> list[int]:
    """Effective token count of each sequence of a verl micro-batch TensorDict (nested or padded)."""
    input_ids = batch["input_ids"]
    if input_ids.is_nested:
        return [int(n) for n in input_ids.offsets().diff().tolist()]
    return [int(n) for n in batch["attention_mask"].sum(dim=1).tolist()]


def ffd_partition_agreed(
    lengths: list[int], capacity: int, min_groups: int, dp_group: Any = None, strategy: str = "ffd"
) -> list[list[int]]:
    """Token-budget micro-batches, with every data-parallel rank agreeing on their count.

    FFD (:func:`ffd_allocate`) where the engine removes padding; where it pads each micro-batch to its
    longest sequence, runs of like length within the padded budget (:func:`padded_allocate`).

    Ranks step in lock-step (all-reduce per round) because each must run the same number of
    forward/backward passes; a rank with fewer micro-batches re-packs with ``min_groups`` raised to
    the largest count until all agree (counts only grow, bounded by the batch size).
    """
    import torch
    import torch.distributed as dist
    from verl.utils.device import get_device_name

    allocate = ALLOCATORS[strategy]
    groups = allocate(lengths, capacity, min_groups=min_groups)
    if dp_group is None or not dist.is_initialized():
        return groups
    while True:
        # On verl's device, as verl's own partitioner does: the data-parallel group may be NCCL-only (a CUDA mesh).
        count = torch.tensor([len(groups), -len(groups)], dtype=torch.long, device=get_device_name())
        dist.all_reduce(count, op=dist.ReduceOp.MAX, group=dp_group)
        largest, smallest = int(count[0]), -int(count[1])
        if largest == smallest:
            return groups
        if largest > len(lengths):
            raise ValueError(
                f"token-budget micro-batching: another data-parallel rank needs {largest} micro-batches, this one has "
                f"{len(lengths)} sequences; raise areal.micro_batch.max_tokens"
            )
        groups = allocate(lengths, capacity, min_groups=largest)


def _make_replacement(original: Any) -> Any:
    @functools.wraps(original)
    def rearrange_micro_batches(
        batch: Any,
        max_token_len: int,
        dp_group: Any = None,
        num_batches_divided_by: Any = None,
        same_micro_num_in_dp: bool = True,
        min_num_micro_batch: Any = None,
        use_dynamic_bsz_balance: bool = True,
        force_group_size: int = 1,
    ) -> Any:
        if force_group_size != 1 or num_batches_divided_by is not None:
            # Grouped samples (reward models) and pipeline stages keep verl's partitioner.
            return original(
                batch,
                max_token_len,
                dp_group=dp_group,
                num_batches_divided_by=num_batches_divided_by,
                same_micro_num_in_dp=same_micro_num_in_dp,
                min_num_micro_batch=min_num_micro_batch,
                use_dynamic_bsz_balance=use_dynamic_bsz_balance,
                force_group_size=force_group_size,
            )
        from verl.utils import tensordict_utils as tu

        lengths = sequence_lengths(batch)
        # verl's engine pads each micro-batch to its longest sequence unless it removes padding.
        padded = not tu.get_non_tensor_data(data=batch, key="use_remove_padding", default=True)
        strategy = "padded_runs" if padded else "ffd"
        groups = ffd_partition_agreed(
            lengths,
            int(max_token_len),
            min_groups=max(int(min_num_micro_batch or 1), 1),
            dp_group=dp_group if same_micro_num_in_dp else None,
            strategy=strategy,
        )
        _record(lengths, groups, int(max_token_len), strategy)
        return [tu.index_select_tensor_dict(batch, group) for group in groups], groups

    return rearrange_micro_batches


def _record(lengths: list[int], groups: list[list[int]], capacity: int, strategy: str) -> None:
    from areal_plugins.records.writer import append_record

    tokens = [sum(lengths[i] for i in group) for group in groups]
    padded = [len(group) * max(lengths[i] for i in group) for group in groups]
    line = {
        "pid": os.getpid(),
        "strategy": strategy,
        "sequences": len(lengths),
        "capacity": capacity,
        "micro_batches": len(groups),
        "sizes": [len(group) for group in groups],
        "tokens": tokens,
        "padded_tokens": padded,
    }
    append_record(LOG_NAME, line)


PATCH = AttributePatch("micro_batch_partitioner", TARGETS, _make_replacement, SUPPORTED_VERL)
apply = PATCH.apply
revert = PATCH.revert
is_applied = PATCH.is_applied
