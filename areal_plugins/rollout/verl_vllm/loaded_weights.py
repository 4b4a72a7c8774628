"""What a vLLM worker holds after loading an update, beside what it received: the report the adapter compares.

vLLM loads the trainer's tensors into its own parameters: ``q_proj``, ``k_proj`` and ``v_proj`` into one
``qkv_proj``, ``gate_proj`` and ``up_proj`` into ``gate_up_proj`` (the model's ``packed_modules_mapping``), each
tensor-parallel rank a shard, the vocabulary padded with zeros. ``Σx`` and ``Σx²`` add up over concatenation and
ignore zero padding, so a parameter's sums equal the sums of its sources, and a sharded parameter's sums over its
tensor-parallel workers equal them too. Padding only adds elements: a parameter holding fewer than its sources is a
shard under tensor parallelism and a short load without it.

Mixture-of-experts layers: vLLM stacks the trainer's per-expert tensors (``experts.E.gate_proj``, ``up_proj``,
``down_proj``) into one parameter per projection (``w13_weight``: every expert's gate then up rows; ``w2_weight``),
by its expert module's own mapping (``get_expert_mapping``; under expert parallelism only this worker's experts).
The tensors that mapping loads into a parameter on this worker are its sources; vLLM's CPU build repacks the
parameter into its kernel's layout, a permutation plus zero padding, which keeps the sums.

Not compared, and counted as such: parameters the engine keeps in a form that cannot be read back (vLLM's CPU build
moves linear layers into its kernels' state), ``qkv_proj`` where tensor parallelism replicates KV heads (its shards
overlap), expert parameters whose module has no ``get_expert_mapping`` (older vLLM), that are sharded over other
workers than one data-parallel rank's tensor-parallel group, or that some of their experts' tensors missed, and
quantized models (their loaded values are not the sent ones).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from areal_plugins.weight_sync.checksums import tensor_checksum

#: Received tensors that no parameter holds by design: rotary caches vLLM recomputes.
NEVER_HELD_SUFFIXES = ("rotary_emb.inv_freq",)


def source_names(held_name: str, packed_modules_mapping: dict[str, list[str]]) -> list[str]:
    """The trainer's tensor names that vLLM loads into parameter ``held_name``: ``a.qkv_proj.weight`` ->
    ``a.q_proj.weight``, ``a.k_proj.weight``, ``a.v_proj.weight``; any other name is its own source."""
    parts = held_name.split(".")
    for index, part in enumerate(parts):
        if part in packed_modules_mapping:
            return [".".join([*parts[:index], source, *parts[index + 1 :]]) for source in packed_modules_mapping[part]]
    return [held_name]


def vllm_name(model: Any, received_name: str) -> str | None:
    """The name vLLM gives a received tensor (models that rename the trainer's names carry a ``hf_to_vllm_mapper``)."""
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    return mapper._map_name(received_name) if mapper is not None else received_name


@dataclass(frozen=True)
class ReceivedTensor:
    """A received tensor's checksum, its dtype, and its checksum rounded to the engine's dtype when it came wider
    (the trainer may send float32 to a bfloat16 engine, which rounds it as it loads)."""

    checksum: list[float]
    dtype: torch.dtype
    rounded: list[float] | None = None

    @classmethod
    def of(cls, tensor: torch.Tensor, engine_dtype: torch.dtype) -> ReceivedTensor:
        wider = tensor.dtype != engine_dtype and torch.promote_types(tensor.dtype, engine_dtype) == tensor.dtype
        rounded = tensor_checksum(tensor, engine_dtype, positions=False) if wider else None  # for after loading only
        return cls(tensor_checksum(tensor), tensor.dtype, rounded)

    def held_in(self, dtype: torch.dtype, engine_dtype: torch.dtype) -> list[float] | None:
        """Its checksum as a parameter of ``dtype`` holds it, or None where that cannot be known from the checksums."""
        if dtype == self.dtype or torch.promote_types(self.dtype, dtype) == dtype:  # the same, or widened exactly
            return self.checksum
        return self.rounded if dtype == engine_dtype else None


def sources_of(name: str, by_vllm_name: dict[str, list[str]], mapping: dict[str, list[str]]) -> list[str] | None:
    """The received tensors loaded into parameter ``name``, or None where one of them is missing. Models either map
    the trainer's names to their fused ones (``hf_to_vllm_mapper``: ``q_proj`` -> ``qkv_proj``) or keep them and
    fuse by ``packed_modules_mapping``; both are read."""
    parts = source_names(name, mapping)
    mapped = by_vllm_name.get(name)
    if mapped is not None:
        return mapped if len(parts) == 1 or len(mapped) == len(parts) else None
    found = [by_vllm_name.get(part) for part in parts]
    return None if any(group is None for group in found) else [n for group in found if group for n in group]


def fused_experts_on_path(modules: dict[str, Any], parts: list[str]) -> str | None:
    """The name of a fused mixture-of-experts module on the path ``parts`` (vLLM's ``FusedMoE``), if any."""
    for end in range(len(parts) - 1, 0, -1):
        module = modules.get(".".join(parts[:end]))
        if module is not None and "MoE" in type(module).__name__:
            return ".".join(parts[:end])
    return None


#: The segment vLLM adds to the names of a layer LoRA wraps.
LORA_BASE_LAYER = "base_layer."


def without_lora(entry: Any) -> tuple[str, str, int, str]:
    """An expert mapping entry with the checkpoint name as the trainer sends it (no ``base_layer.``)."""
    prefix, checkpoint_name, expert, shard = entry
    return prefix, checkpoint_name.replace(LORA_BASE_LAYER, ""), expert, shard


@dataclass
class ExpertReport:
    """What :func:`expert_report` found: entries as :func:`loaded_report` makes them, parameters not compared, the
    received tensors the expert mappings account for, the parameters handled, and the experts' name prefixes."""

    entries: dict[str, dict[str, Any]]
    unchecked: list[str]
    covered: set[str]
    handled: set[str]
    layers: set[str]


def expert_report(
    model: Any,
    received: dict[str, ReceivedTensor],
    by_vllm_name: dict[str, list[str]],
    engine_dtype: torch.dtype,
    tensor_parallel_size: int,
) -> ExpertReport:
    """Each fused expert parameter beside the received tensors vLLM's expert mapping loads into it on this worker.

    vLLM's loader (``RoutedExperts.load_weights``, vLLM 0.30) matches each mapping entry ``(parameter prefix,
    checkpoint name, physical expert, shard)`` by substring against the received name under the layer's prefix and
    loads the tensor into that expert's slot where the expert is local; so is it summed here. A tensor that matches
    only the mapping's fused entries (sent already stacked) leaves its layer not compared; one that matches no entry
    is loaded by nothing and left for ``not_held``. Under LoRA the mapping's names carry vLLM's ``base_layer.``,
    the trainer's may or may not (verl adds it as it loads): names are matched without it."""
    found = ExpertReport({}, [], set(), set(), set())
    for module_name, module in model.named_modules():
        get_mapping = getattr(module, "get_expert_mapping", None)
        layer = getattr(module, "layer_name", None)
        if not callable(get_mapping) or not isinstance(layer, str) or "w13_weight" not in module._parameters:
            continue
        found.layers.add(layer)
        parameters = dict(module.named_parameters(recurse=False))
        found.handled.update(f"{module_name}.{name}" for name in parameters)
        per_expert = [without_lora(entry) for entry in get_mapping()]
        try:
            fused = [without_lora(entry) for entry in get_mapping(include_fused=True)]
        except TypeError:  # a mapping without fused entries
            fused = []
        fused = [entry for entry in fused if entry not in per_expert]
        local = getattr(module, "_map_global_expert_id_to_local_expert_id", None)
        config = getattr(getattr(module, "moe_config", None), "moe_parallel_config", None)
        shards = getattr(config, "tp_size", None)  # vLLM flattens data parallelism into it without expert parallelism
        comparable = callable(local) and shards in (1, tensor_parallel_size)
        slots_needed: dict[str, set[tuple[int, str]]] = {}
        if callable(local):
            for prefix, _, expert, shard in per_expert:
                if local(expert) != -1:
                    slots_needed.setdefault(prefix, set()).add((expert, shard))
        sources: dict[str, list[str]] = {}
        slots: dict[str, set[tuple[int, str]]] = {}
        prefix_of: dict[str, str] = {}
        for mapped, names in by_vllm_name.items():
            name = mapped.replace(LORA_BASE_LAYER, "")
            if not name.startswith(f"{layer}."):
                continue
            matches = [entry for entry in per_expert if entry[1] in name]
            if not matches:
                if any(entry[1] in name for entry in fused):
                    found.covered.update(names)
                    comparable = False
                continue
            found.covered.update(names)
            for prefix, checkpoint_name, expert, shard in matches:
                if not callable(local) or local(expert) == -1:  # another expert-parallel worker's expert
                    continue
                held_as = name.replace(checkpoint_name, prefix).removeprefix(f"{layer}.")
                sources.setdefault(held_as, []).extend(names)
                slots.setdefault(held_as, set()).add((expert, shard))
                prefix_of[held_as] = prefix
        for parameter_name, parameter in parameters.items():
            name = f"{module_name}.{parameter_name}"
            loaded = sources.get(parameter_name, [])
            complete = bool(loaded) and slots[parameter_name] == slots_needed.get(prefix_of[parameter_name])
            as_held = [received[source].held_in(parameter.dtype, engine_dtype) for source in loaded]
            if not comparable or not complete or parameter.numel() == 0 or None in as_held:
                found.unchecked.append(name)
                continue
            expected = sums(checksum for checksum in as_held if checksum is not None)
            held = tensor_checksum(parameter, positions=False)
            sharded = tensor_parallel_size > 1 and held[0] < expected[0]
            found.entries[name] = {"held": held, "expected": expected, "sharded": sharded}
    return found


def sums(checksums: Iterable[list[float]]) -> list[float]:
    total = [0.0, 0.0, 0.0]  # elements, Σx, Σx²: what after-load comparisons use
    for checksum in checksums:
        total = [a + b for a, b in zip(total, checksum[:3], strict=True)]
    return total


def loaded_report(
    model: Any,
    received: dict[str, ReceivedTensor],
    engine_dtype: torch.dtype,
    tensor_parallel_size: int,
    quantized: bool,
    tied_embeddings: bool,
    kernels_own_weights: bool = False,
    shard_group: tuple[int, int] = (0, 0),
) -> dict[str, Any]:
    """For each parameter this worker can read: its checksum (``held``) and the sum of its sources' checksums as
    received, rounded to its dtype (``expected``); whether it is a shard; the parameters not compared; and
    received tensors that no parameter holds. ``kernels_own_weights`` (vLLM's CPU build, which moves its linear
    layers' weights into its kernels' state on every load): a module without the parameter holds it unreadably.
    ``shard_group``: this worker's (data-parallel, pipeline) ranks; the shards of one parameter are summed over
    the ``tensor_parallel_size`` workers of one group."""
    parallel = {"tensor_parallel_size": tensor_parallel_size, "shard_group": list(shard_group)}
    if quantized:
        return {"entries": {}, "unchecked": [], "not_held": [], "skipped": "quantized weights", **parallel}
    mapping = getattr(model, "packed_modules_mapping", None) or {}
    by_vllm_name: dict[str, list[str]] = {}
    dropped: list[str] = []  # names the model drops on purpose (its mapper maps them to nothing)
    for received_name in received:
        mapped = vllm_name(model, received_name)
        if mapped is None:
            dropped.append(received_name)
        else:
            by_vllm_name.setdefault(mapped, []).append(received_name)
    experts = expert_report(model, received, by_vllm_name, engine_dtype, tensor_parallel_size)
    entries: dict[str, dict[str, Any]] = dict(experts.entries)
    unchecked: list[str] = [*sorted(dropped), *experts.unchecked]
    covered: set[str] = set(dropped) | experts.covered
    for module_name, module in model.named_modules():
        overlapping = tensor_parallel_size > 1 and getattr(module, "num_kv_head_replicas", 1) > 1
        for parameter_name, parameter in module.named_parameters(recurse=False):
            name = f"{module_name}.{parameter_name}" if module_name else parameter_name
            if name in experts.handled:
                continue
            sources = sources_of(name, by_vllm_name, mapping)
            covered.update(sources or by_vllm_name.get(name, []))
            as_held = [received[source].held_in(parameter.dtype, engine_dtype) for source in sources or []]
            if parameter.numel() == 0 or overlapping or not sources or None in as_held:
                unchecked.append(name)
                continue
            expected = sums(checksum for checksum in as_held if checksum is not None)
            held = tensor_checksum(parameter, positions=False)
            sharded = tensor_parallel_size > 1 and held[0] < expected[0]  # without TP, fewer is a short load
            entries[name] = {"held": held, "expected": expected, "sharded": sharded}
    modules = dict(model.named_modules())
    packed_into = {source: packed for packed, sources in mapping.items() for source in sources}
    for name in sorted(set(received) - covered):
        parts = [packed_into.get(part, part) for part in (vllm_name(model, name) or name).split(".")]
        module = modules.get(".".join(parts[:-1]))
        # the module is there, the parameter is not (registered ones are covered above); or fused experts without
        # an expert mapping to read (where there is one, a name it does not match is loaded by nothing)
        held_elsewhere = fused_experts_on_path(modules, parts)
        if held_elsewhere in experts.layers:
            held_elsewhere = None
        if (kernels_own_weights and module is not None) or held_elsewhere:
            covered.add(name)
            holder = held_elsewhere or ".".join(parts)
            if holder not in unchecked:
                unchecked.append(holder)
    buffers = {name for name, _ in model.named_buffers()}
    not_held = sorted(
        name
        for name in set(received) - covered
        if not name.endswith(NEVER_HELD_SUFFIXES)
        and vllm_name(model, name) not in buffers
        and not (tied_embeddings and name.startswith("lm_head."))
    )
    return {"entries": entries, "unchecked": unchecked, "not_held": not_held, **parallel}
