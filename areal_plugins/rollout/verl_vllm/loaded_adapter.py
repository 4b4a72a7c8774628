"""What a vLLM worker holds of a LoRA adapter after loading it, beside what it received: one rank's adapter report.

verl loads the trainer's adapter (peft's ``base_model.model.<module>.lora_A.weight`` / ``.lora_B.weight``) with
``add_lora`` and a ``TensorLoRARequest`` (verl's ``vLLMColocateWorkerExtension._update_weights``). vLLM then keeps it
twice: a registered ``LoRAModel`` (``q_proj``/``k_proj``/``v_proj`` packed into one ``qkv_proj`` entry, ``lora_B``
multiplied by ``lora_alpha / r`` in the adapter's dtype: ``LoRALayerWeights.optimize``), and the copy the forward pass
reads: each LoRA layer's slot of ``lora_a_stacked`` / ``lora_b_stacked`` (``set_lora``; under tensor parallelism
this rank's part, cut by the layer's own ``slice_lora_a`` / ``slice_lora_b``). The report reads the slots, so what
is compared is what the engine samples with.

Per trainer tensor name (weight_sync/adapter_check.py compares them with what the trainer sent):

* ``received``: the tensor as it arrived (position-weighted checksum);
* ``expected``: what the slot should hold, computed here from the received tensor by vLLM's own operations (the cast
  to the adapter's dtype, for ``lora_B`` the scaling, under tensor parallelism the layer's cut of this rank's part:
  rows of ``lora_B`` on column-parallel layers, columns of ``lora_A`` on row-parallel ones, a replicated KV head's
  rows on each of its ranks), so the comparison is position by position and needs no tolerance;
* ``held``: the slot's values, ``[:r]`` rows of ``lora_a`` and ``[:, :r]`` columns of ``lora_b`` (the slot is padded
  to ``max_lora_rank``).

A slot whose module vLLM holds an adapter for but whose name no received tensor maps to is reported under the
trainer's naming (``base_model.model.<module>.lora_A.weight``), so a tensor loaded under the wrong name is named.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from areal_plugins.weight_sync.checksums import PendingChecksums

#: verl's id of the adapter it loads (``verl.workers.rollout.vllm_rollout.utils.VLLM_LORA_INT_ID``).
VERL_LORA_INT_ID = 123
#: The prefix of peft's adapter tensor names (what verl's trainer sends).
PEFT_PREFIX = "base_model.model."

#: This rank's part of a whole adapter tensor (:func:`rank_part`).
Cut = Callable[[torch.Tensor], torch.Tensor]
#: What :func:`held_adapter` gives per trainer tensor name: the slot's values (a view), the adapter's dtype, whether
#: it is lora_A, and the cut of this rank's part.
Held = tuple[torch.Tensor, torch.dtype, bool, Cut]


def trainer_name(module: str, is_lora_a: bool, peft_prefix: bool = True) -> str:
    """The name the trainer gives the adapter tensor of ``module`` (vLLM's module name)."""
    return f"{PEFT_PREFIX if peft_prefix else ''}{module}.lora_{'A' if is_lora_a else 'B'}.weight"


def module_of(name: str, weights_mapper: Any = None) -> tuple[str, bool]:
    """``(module, is lora_A)`` that vLLM loads the received adapter tensor ``name`` into (its own parser)."""
    from vllm.lora.utils import parse_fine_tuned_lora_name

    return parse_fine_tuned_lora_name(name, weights_mapper)


def rename_mapper(model: Any) -> Any:
    """The weights mapper vLLM (and verl's tensor loader) names LoRA modules with: the model's renames only."""
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    if mapper is None:
        return None
    for method in ("get_rename_mapper", "get_unstacked_mapper"):  # vLLM >= 0.30 / 0.25-0.29
        if hasattr(mapper, method):
            return getattr(mapper, method)()
    return mapper  # vLLM 0.24.0: neither; its LoRA loader (WorkerLoRAManager._load_adapter) reads the mapper as it is


def held_adapter(manager: Any, received_names: list[str], lora_id: int = VERL_LORA_INT_ID) -> dict[str, Held] | None:
    """What the forward pass reads of adapter ``lora_id``, by trainer tensor name (:data:`Held`); None where the
    engine holds no such adapter in a slot.

    Args:
        manager: vLLM's LoRA model manager (``model_runner.lora_manager._adapter_manager``).
        received_names: the names the adapter's tensors arrived under (the held ones are reported under these).
        lora_id: the adapter's id in the engine.
    """
    lora_model = manager.get_adapter(lora_id)
    if lora_model is None or lora_id not in manager.lora_index_to_id:
        return None
    slot = manager.lora_index_to_id.index(lora_id)
    mapper = rename_mapper(manager.model)
    by_module = {module_of(name, mapper): name for name in received_names}
    peft_prefix = not received_names or any(name.startswith(PEFT_PREFIX) for name in received_names)
    packed = dict(manager.packed_modules_mapping)
    held: dict[str, Held] = {}
    for module_name, layer in manager.modules.items():
        weights = lora_model.get_lora(module_name)
        if weights is None or not hasattr(layer, "lora_a_stacked"):
            continue
        prefix, _, leaf = module_name.rpartition(".")
        subs = [f"{prefix}.{sub}" if prefix else sub for sub in packed.get(leaf, [leaf])]
        parts = len(weights.lora_a) if isinstance(weights.lora_a, list) else None  # a packed layer's sub-modules
        lora_as = weights.lora_a if isinstance(weights.lora_a, list) else [weights.lora_a]
        lora_bs = weights.lora_b if isinstance(weights.lora_b, list) else [weights.lora_b]
        for index, (sub, lora_a, lora_b) in enumerate(zip(subs, lora_as, lora_bs, strict=False)):
            if lora_a is None or lora_b is None:  # a packed module without this part
                continue
            rank = int(lora_a.shape[0])  # the slot is padded to max_lora_rank
            for is_a, values, dtype in (
                (True, layer.lora_a_stacked[index][slot, 0, :rank, :], lora_a.dtype),
                (False, layer.lora_b_stacked[index][slot, 0, :, :rank], lora_b.dtype),
            ):
                name = by_module.get((sub, is_a)) or trainer_name(sub, is_a, peft_prefix)
                held[name] = (values, dtype, is_a, rank_part(layer, is_a, index, parts))
    return held


def rank_part(layer: Any, is_lora_a: bool, index: int = 0, parts: int | None = None) -> Cut:
    """This rank's part of a whole ``lora_A`` (``is_lora_a``) or ``lora_B`` tensor of vLLM LoRA ``layer``, cut as its
    ``set_lora`` cuts it: by the layer's own ``slice_lora_a`` / ``slice_lora_b``, under tensor parallelism only. A
    packed layer's (``parts`` sub-modules) take a list, one entry per sub-module: the tensor at ``index``."""
    if getattr(layer, "tp_size", 1) <= 1:
        return lambda tensor: tensor
    cut = layer.slice_lora_a if is_lora_a else layer.slice_lora_b
    if parts is None:
        return cut

    def packed_cut(tensor: torch.Tensor) -> torch.Tensor:
        entries: list[torch.Tensor | None] = [None] * parts
        entries[index] = tensor
        return cut(entries)[index]

    return packed_cut


def adapter_report(
    held: dict[str, Held],
    received: dict[str, torch.Tensor],
    received_checksums: dict[str, list[float]],
    scaling: float,
) -> dict[str, dict[str, Any]]:
    """This rank's adapter entries (module docstring) from :func:`held_adapter`'s answer.

    Args:
        held: :func:`held_adapter`'s answer.
        received: the adapter tensors this rank received in the update, by the names they arrived under.
        received_checksums: their checksums as recorded on arrival (``tensor_checksum``).
        scaling: what vLLM multiplies ``lora_B`` by (``PEFTHelper.vllm_lora_scaling_factor``).

    Every checksum is reduced where its tensor lies and all are read to the host at once (``PendingChecksums``), not
    two or three per adapter tensor.
    """
    pending = PendingChecksums()
    for name, (values, dtype, is_a, cut) in held.items():
        _queue(pending, name, values, received.get(name), received_checksums.get(name), dtype, is_a, scaling, cut)
    sums = pending.resolve()
    report: dict[str, dict[str, Any]] = {}
    for name in held:
        if (name, "expected") not in sums:  # held without having arrived under this name (stale or misnamed)
            report[name] = {"received": sums[(name, "held")], "held": sums[(name, "held")]}
            continue
        known = received_checksums.get(name)
        report[name] = {
            "received": known if known is not None else sums[(name, "received")],
            "expected": sums[(name, "expected")],
            "held": sums[(name, "held")],
        }
    return report


def corrupt_slot(manager: Any, name: str, lora_id: int = VERL_LORA_INT_ID) -> None:
    """Fault injection (tests): add 1 to the first value of the slot the forward pass reads for trainer tensor
    ``name``, found through the layers' own packing (not through :func:`held_adapter`, which it tests)."""
    module, is_a = module_of(name, rename_mapper(manager.model))
    prefix, _, leaf = module.rpartition(".")
    layer_name, index = module, 0
    for packed, parts in manager.packed_modules_mapping.items():
        if leaf in parts:
            layer_name, index = f"{prefix}.{packed}", list(parts).index(leaf)
    stacked = manager.modules[layer_name].lora_a_stacked if is_a else manager.modules[layer_name].lora_b_stacked
    with torch.no_grad():
        stacked[index][manager.lora_index_to_id.index(lora_id), 0, 0, 0] += 1.0


def unpaired(names: list[str], weights_mapper: Any = None) -> list[tuple[str, str]]:
    """``(missing, present)`` for each module of which only one of ``lora_A``/``lora_B`` arrived: vLLM cannot load
    such an adapter (it fails inside ``add_lora`` without naming the tensor)."""
    modules: dict[str, dict[bool, str]] = {}
    for name in names:
        module, is_a = module_of(name, weights_mapper)
        modules.setdefault(module, {})[is_a] = name
    missing = []
    for module, halves in sorted(modules.items()):
        if len(halves) == 1:
            ((is_a, present),) = halves.items()
            prefix = PEFT_PREFIX if present.startswith(PEFT_PREFIX) else ""
            missing.append((trainer_name(module, not is_a, bool(prefix)), present))
    return missing


def _queue(
    pending: PendingChecksums,
    name: str,
    held: torch.Tensor,
    received: torch.Tensor | None,
    received_checksum: list[float] | None,
    dtype: torch.dtype,
    is_lora_a: bool,
    scaling: float,
    cut: Cut,
) -> None:
    """Queue the checksums of one adapter entry under ``(name, "held" | "expected" | "received")``."""
    pending.add((name, "held"), held)
    if received is None:  # held without having arrived under this name: only what is held
        return
    expected_tensor = received.to(dtype=dtype)
    if not is_lora_a and scaling != 1:
        expected_tensor = expected_tensor * scaling  # LoRALayerWeights.optimize: lora_b *= scaling, in its dtype
    pending.add((name, "expected"), cut(expected_tensor))  # set_lora: this rank's part of the registered tensor
    if received_checksum is None:
        pending.add((name, "received"), received)
