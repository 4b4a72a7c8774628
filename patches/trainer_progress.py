"""Patch: verl's FSDP engine counts the micro-batches it starts, for the stall guard (``areal_async``).

*Why*: the stall guard judges a step by its progress, not its length (a 7B step computes for tens of
minutes); a trainer worker busy in ``compute_log_prob`` or ``update_actor`` cannot be asked anything (a Ray
actor runs one call at a time), so it must say itself that it moves. verl 0.9.1's engine loops over the
micro-batches ``prepare_micro_batches`` returns (``forward_backward_batch`` in
``verl/workers/engine/fsdp/transformer_impl.py``) and has no callback per micro-batch. The replacement returns
the same micro-batches in a list that reports each one as the loop takes it
(:func:`areal_plugins.actors.progress_board.report_progress`, ``trainer_micro_batches``); nothing else changes.
Megatron's engine is not covered (verl's megatron engine does not import here); there the guard sees the
engines, the phases and the weight syncs only.
*Upstream*: no seam in verl 0.9.1. *Remove when*: verl's engine offers a per-micro-batch
callback; no upstream issue yet: watch ``verl/workers/engine/fsdp/transformer_impl.py`` (``prepare_micro_batches``).

The trainer applies it inside the actor worker processes
(:func:`areal_plugins.driver.worker_calls.apply_patches_in_workers`).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

from areal_plugins.patches._base import AttributePatch

from areal_plugins._compat import SUPPORTED_VERL

TARGETS = (("verl.workers.engine.fsdp.transformer_impl", "prepare_micro_batches"),)
#: The progress counter the stall guard reads.
KIND = "trainer_micro_batches"


class CountedMicroBatches(list):
    """verl's micro-batch list; iterating reports each micro-batch as it is taken."""

    def __iter__(self) -> Iterator[Any]:
        from areal_plugins.actors.progress_board import report_progress

        for micro_batch in super().__iter__():
            report_progress(KIND)
            yield micro_batch


def _make_replacement(original: Any) -> Any:
    @functools.wraps(original)
    def prepare_micro_batches(*args: Any, **kwargs: Any) -> Any:
        micro_batches, indices = original(*args, **kwargs)
        return CountedMicroBatches(micro_batches), indices

    return prepare_micro_batches


PATCH = AttributePatch("trainer_progress", TARGETS, _make_replacement, SUPPORTED_VERL)
apply = PATCH.apply
revert = PATCH.revert
is_applied = PATCH.is_applied
