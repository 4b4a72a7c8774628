"""Patch: a vision-language model's M-RoPE ``position_ids`` kept ragged in their tokens whatever the batch's lengths.

*Why*: a Qwen2-VL's ``position_ids`` are (4, tokens) per sample, a three-dimensional nested tensor in the trainer's
batch. ``torch.nested.as_nested_tensor`` makes the *first* dimension the ragged one when every sample has the same
length (values (samples x 4, tokens), offsets 4 apart), and verl 0.9.1's ``maybe_fix_3d_position_ids`` (run on every
batch the trainer workers receive) then relabels the tensor ragged in its tokens (``_ragged_idx = 2``) without
moving its values. Selecting rows of it (verl's ``index_select_tensor_dict``: mini-batches, token-budget
micro-batches) then split the wrong dimension and the step stopped with ``split_with_sizes expects split_sizes to sum
exactly to <tokens>, but got split_sizes=[4, 4, ...]``; verl's padding-free path would read such values as one
sequence. Seen here whenever every response of a batch ran to the same length.
*How*: where verl relabels, the tensor is rebuilt from its samples (cut from the values along the dimension whose
size the offsets sum to) ragged in its tokens: values (4, all tokens), ``_ragged_idx`` 2, the layout verl's engine
reads with and without padding removal. A tensor already so laid out is rebuilt the same.
*Upstream*: no seam; verl 0.9.1 ``verl/utils/tensordict_utils.py`` (``maybe_fix_3d_position_ids``), imported by name
into ``verl/workers/engine_workers.py`` and ``verl/workers/engine/base.py``. *Remove when*: verl builds or fixes these
tensors by their offsets; no upstream issue yet: watch ``maybe_fix_3d_position_ids``.

The trainer applies it in its worker processes (:func:`areal_plugins.driver.worker_calls.apply_patches_in_workers`)
for a model whose ``config.json`` has a ``vision_config``.
"""

from __future__ import annotations

from typing import Any

from areal_plugins.patches._base import AttributePatch

from areal_plugins._compat import SUPPORTED_VERL

TARGETS = (
    ("verl.utils.tensordict_utils", "maybe_fix_3d_position_ids"),
    ("verl.workers.engine_workers", "maybe_fix_3d_position_ids"),
    ("verl.workers.engine.base", "maybe_fix_3d_position_ids"),
)


def ragged_in_tokens(nested: Any) -> Any:
    """``nested`` (a jagged nested tensor of (..., tokens) samples) rebuilt ragged in its last dimension."""
    from verl.utils import tensordict_utils as tu

    values, lengths = nested.values(), nested.offsets().diff().tolist()
    cut = next(dim for dim in range(values.dim()) if values.shape[dim] == sum(lengths))
    return tu.nested_tensor_from_tensor_list(list(values.split(lengths, dim=cut)), ragged_idx=values.dim())


def _replacement(original: Any) -> Any:
    def maybe_fix_3d_position_ids(data: Any) -> None:
        positions = data.get("position_ids", None) if "position_ids" in data.keys() else None
        if positions is None or not positions.is_nested or positions.dim() != 3:
            return original(data)
        data["position_ids"] = ragged_in_tokens(positions)
        return None

    return maybe_fix_3d_position_ids


PATCH = AttributePatch("vlm_position_ids", TARGETS, _replacement, SUPPORTED_VERL)
apply = PATCH.apply
revert = PATCH.revert
is_applied = PATCH.is_applied
