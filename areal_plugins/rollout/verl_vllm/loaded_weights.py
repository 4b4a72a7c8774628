"""What a vLLM worker holds after loading an update, beside what it received: the report the adapter compares.

vLLM loads the trainer's tensors into its own parameters: ``q_proj``, ``k_proj`` and ``v_proj`` into one
``qkv_proj``, ``gate_proj`` and ``up_proj`` into ``gate_up_proj`` (the model's ``packed_modules_mapping``), each
tensor-parallel rank a shard, the vocabulary padded with zeros. ``Σx`` and ``Σx²`` add up over concatenation and
ignore zero padding, so a parameter's sums equal the sums of its sources, and a sharded parameter's sums over its
tensor-parallel workers equal them too. Padding only adds elements: a parameter holding fewer than its sources is a
shard under tensor parallelism and a short load without it.

Mixture-of-experts layers: vLLM stacks the trainer's per-expert tensors (``experts.E.gate_proj``, ``up_proj``,
``down_proj``) into one parameter per projection (``w13_weight``: every expert's gate then up rows; ``w2_weight``),
by vLLM's expert mapping (``get_expert_mapping``; under expert parallelism only this worker's experts), which vLLM
0.30 keeps on the expert layer (``RoutedExperts``) and vLLM 0.24.0, verl 0.9.1's GPU pin, on the model class
(``Qwen2MoeModel``, ``Qwen3MoeModel``): the layer is asked first, then the modules above it. The tensors that mapping
loads into a parameter on this worker are its sources; vLLM's CPU build repacks the parameter into its kernel's
layout, a permutation plus zero padding, which keeps the sums.

LoRA: vLLM holds a wrapped layer's base weight under ``base_layer.`` (``qkv_proj.base_layer.weight``); verl 0.9.1's
FSDP engine sends it without (``verl/utils/fsdp_utils.py``, collect_lora_params), peft names it with. Names are
matched without it, on every device.

Not compared, and counted as such: parameters the engine keeps in a form that cannot be read back (vLLM's CPU build
moves linear layers' weights into its kernels' state and leaves the parameter empty), ``qkv_proj`` where tensor
parallelism replicates KV heads (its shards overlap), expert parameters sharded over other workers than one
data-parallel rank's tensor-parallel group, sent already stacked, or that some of their experts' tensors missed, and
quantized models (their loaded values are not the sent ones). Fused expert parameters with no expert mapping on their
layer or above it are counted too, and the report says so: the update check stops where the workers hold fused
expert parameters and none was compared (weight_sync/checksums.py, ``check_loaded_reports``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from areal_plugins.weight_sync.checksums import PendingChecksums, recheck_kept

#: Received tensors that no parameter holds by design: rotary caches vLLM recomputes.
NEVER_HELD_SUFFIXES = ("rotary_emb.inv_freq",)
#: The segment vLLM adds to the names of a layer LoRA wraps.
LORA_BASE_LAYER = "base_layer."
#: The parameters of vLLM's fused experts (every expert's gate and up rows; every expert's down rows).
FUSED_EXPERT_PARAMETERS = ("w13_weight", "w2_weight")


def source_names(held_name: str, packed_modules_mapping: dict[str, list[str]]) -> list[str]:
    """The trainer's tensor names that vLLM loads into parameter ``held_name``: ``a.qkv_proj.weight`` ->
    ``a.q_proj.weight``, ``a.k_proj.weight``, ``a.v_proj.weight``; any other name is its own source."""
    parts = held_name.split(".")
    for index, part in enumerate(parts):
        if part in packed_modules_mapping:
            return [".".join([*parts[:index], source, *parts[index + 1 :]]) for source in packed_modules_mapping[part]]
    return [held_name]


def vllm_name(model: Any, received_name: str) -> str | None:
    """The name vLLM gives a received tensor (models that rename the trainer's names carry a ``hf_to_vllm_mapper``;
    vLLM 0.30's Qwen2 has one, 0.24.0's none), without LoRA's ``base_layer.``."""
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    mapped = mapper._map_name(received_name) if mapper is not None else received_name
    return None if mapped is None else mapped.replace(LORA_BASE_LAYER, "")


@dataclass(frozen=True)
class ReceivedTensor:
    """A received tensor's checksum, its dtype, and its checksum rounded to the engine's dtype when it came wider
    (the trainer may send float32 to a bfloat16 engine, which rounds it as it loads)."""

    checksum: list[float]
    dtype: torch.dtype
    rounded: list[float] | None = None

    @classmethod
    def of(cls, tensor: torch.Tensor, engine_dtype: torch.dtype) -> ReceivedTensor:
        """One tensor's (:class:`ReceivedChecksums` for an update's)."""
        received = ReceivedChecksums(engine_dtype)
        received.add("", tensor)
        return received.resolve()[""]

    def held_in(self, dtype: torch.dtype, engine_dtype: torch.dtype) -> list[float] | None:
        """Its checksum as a parameter of ``dtype`` holds it, or None where that cannot be known from the checksums."""
        if dtype == self.dtype or torch.promote_types(self.dtype, dtype) == dtype:  # the same, or widened exactly
            return self.checksum
        return self.rounded if dtype == engine_dtype else None


class ReceivedChecksums:
    """The tensors a worker receives in one update, as :class:`ReceivedTensor` each: reduced on the tensor's device
    as it is added and read to the host with all the others in :meth:`resolve` (:class:`PendingChecksums`), one host
    synchronisation per update instead of one or two per tensor (issue 59: 37,734 at Qwen3-30B-A3B's 18,867 float32
    tensors). Add a bucket's tensors before the transport reuses its buffer: the reductions are queued then, and
    verl's receiver synchronises the device after each bucket before it lets the sender refill it
    (``BucketedWeightReceiver.receive_weights``)."""

    def __init__(self, engine_dtype: torch.dtype) -> None:
        self.engine_dtype = engine_dtype
        self._pending = PendingChecksums()
        self._dtypes: dict[str, torch.dtype] = {}

    def add(self, name: str, tensor: torch.Tensor) -> None:
        self._pending.add(name, tensor)
        wider = (
            tensor.dtype != self.engine_dtype and torch.promote_types(tensor.dtype, self.engine_dtype) == tensor.dtype
        )
        if wider:  # also rounded as the engine rounds it when it loads it, for after loading only
            self._pending.add((name, "rounded"), tensor, self.engine_dtype, positions=False)
        self._dtypes[name] = tensor.dtype

    def resolve(self) -> dict[str, ReceivedTensor]:
        """Every tensor added so far, by name."""
        sums = self._pending.resolve()
        return {
            name: ReceivedTensor(sums[name], dtype, sums.get((name, "rounded"))) for name, dtype in self._dtypes.items()
        }


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
        if module is not None and "MoE" in type(module).__name__:  # vLLM 0.24.0 and 0.30: a MoERunner
            return ".".join(parts[:end])
    return None


def without_lora(entry: Any) -> tuple[str, str, int, str]:
    """An expert mapping entry with the checkpoint name as the trainer sends it (no ``base_layer.``)."""
    prefix, checkpoint_name, expert, shard = entry
    return prefix, checkpoint_name.replace(LORA_BASE_LAYER, ""), expert, shard


@dataclass
class ExpertReport:
    """What :func:`expert_report` found: entries as :func:`loaded_report` makes them, parameters not compared, the
    received tensors the expert mappings account for, the parameters handled, the name prefixes of the experts with
    a mapping, the fused expert parameters held, and why some could not be compared by design."""

    entries: dict[str, dict[str, Any]] = field(default_factory=dict)
    unchecked: list[str] = field(default_factory=list)
    covered: set[str] = field(default_factory=set)
    handled: set[str] = field(default_factory=set)
    layers: set[str] = field(default_factory=set)
    fused: list[str] = field(default_factory=list)
    not_comparable: set[str] = field(default_factory=set)

    def summary(self) -> dict[str, Any]:
        """The report's ``experts`` entry: what the update check needs to stop one that compared none of them."""
        compared = [name for name in self.fused if name in self.entries]
        return {
            "parameters": len(self.fused),
            "compared": len(compared),
            "example": self.fused[0] if self.fused else None,
            "not_comparable": sorted(self.not_comparable),
        }


@dataclass(frozen=True)
class ExpertMapping:
    """vLLM's expert mapping for one fused-experts layer: entries ``(parameter prefix, checkpoint name, physical
    expert, shard)`` per expert, those for tensors sent already stacked (``fused``), and the name its parameter
    names are relative to once a received name's checkpoint part is replaced by the prefix: the layer's
    ``layer_name`` where the mapping is the layer's own (vLLM 0.30: ``experts.w13_``, from RoutedExperts'
    build_expert_params_mapping), the model's root where it is the model's (vLLM 0.24.0: its
    make_expert_params_mapping's ``experts.routed_experts.w13_``, the parameter's name in the model)."""

    per_expert: list[tuple[str, str, int, str]]
    fused: list[tuple[str, str, int, str]]
    relative_to: str

    def parameter(self, received: str, checkpoint_name: str, prefix: str) -> str:
        """The (model-wide or layer-relative) name vLLM loads ``received`` into by one entry, without LoRA's
        ``base_layer.``."""
        return received.replace(checkpoint_name, prefix).replace(LORA_BASE_LAYER, "")


def expert_mapping(
    modules: dict[str, Any], module_name: str, module: Any, cache: dict[int, list[Any]] | None = None
) -> ExpertMapping | None:
    """The expert mapping vLLM loads ``module``'s fused parameters by: the module's own ``get_expert_mapping``
    (vLLM 0.30's ``RoutedExperts``), else the nearest enclosing module's (vLLM 0.24.0: the model class, whose
    ``load_weights`` reads it); None where neither has one. ``cache``: mappings already asked for, by owner."""
    cache = {} if cache is None else cache
    layer = getattr(module, "layer_name", None)
    parts = module_name.split(".") if module_name else []
    for end in range(len(parts), -1, -1):
        owner_name = ".".join(parts[:end])
        owner = module if end == len(parts) else modules.get(owner_name)
        get_mapping = getattr(owner, "get_expert_mapping", None)
        if not callable(get_mapping):
            continue
        if id(owner) not in cache:
            per_expert = [without_lora(entry) for entry in get_mapping()]
            try:
                fused = [without_lora(entry) for entry in get_mapping(include_fused=True)]
            except TypeError:  # a mapping without fused entries (vLLM 0.24.0's model classes)
                fused = []
            cache[id(owner)] = [per_expert, [entry for entry in fused if entry not in per_expert]]
        per_expert, fused = cache[id(owner)]
        own = owner is module or (isinstance(layer, str) and owner_name == layer)
        return ExpertMapping(per_expert, fused, f"{layer}." if own else "")
    return None


def expert_report(
    model: Any,
    received: dict[str, ReceivedTensor],
    by_vllm_name: dict[str, list[str]],
    engine_dtype: torch.dtype,
    tensor_parallel_size: int,
    pending: PendingChecksums,
) -> ExpertReport:
    """Each fused expert parameter beside the received tensors vLLM's expert mapping loads into it on this worker.

    vLLM's loaders (``RoutedExperts.load_weights`` in vLLM 0.30, the model's ``load_weights`` in 0.24.0) match each
    mapping entry ``(parameter prefix, checkpoint name, physical expert, shard)`` by substring against the received
    name and load the tensor into that expert's slot where the expert is local; so is it summed here. A tensor that
    matches only the mapping's fused entries (sent already stacked) leaves its layer not compared; one that matches
    no entry is loaded by nothing and left for ``not_held``. Under LoRA the mapping's names carry vLLM's
    ``base_layer.``, the trainer's may or may not (verl adds it as it loads): names are matched without it. Each
    compared parameter's checksum is queued on ``pending`` under its name; its entry's ``held`` is filled from
    there (:func:`loaded_report`)."""
    found = ExpertReport()
    modules = dict(model.named_modules())
    mappings: dict[int, list[Any]] = {}
    for module_name, module in modules.items():
        if "w13_weight" not in module._parameters:
            continue
        parameters = dict(module.named_parameters(recurse=False))
        found.handled.update(f"{module_name}.{name}" for name in parameters)
        found.fused.extend(f"{module_name}.{name}" for name in parameters if name in FUSED_EXPERT_PARAMETERS)
        layer = getattr(module, "layer_name", None)
        mapping = expert_mapping(modules, module_name, module, mappings) if isinstance(layer, str) else None
        if mapping is None or not isinstance(layer, str):  # nothing says which tensor each expert's slot holds
            found.unchecked.extend(f"{module_name}.{name}" for name in parameters)
            continue
        found.layers.add(layer)
        holder = mapping.relative_to or f"{module_name.replace(LORA_BASE_LAYER, '')}."
        local = getattr(module, "_map_global_expert_id_to_local_expert_id", None)
        config = getattr(getattr(module, "moe_config", None), "moe_parallel_config", None)
        shards = getattr(config, "tp_size", None)  # vLLM flattens data parallelism into it without expert parallelism
        comparable = callable(local) and shards in (1, tensor_parallel_size)
        if callable(local) and not comparable:
            found.not_comparable.add(
                f"expert parameters sharded over {shards} workers, not one tensor-parallel group of "
                f"{tensor_parallel_size} (data parallelism without expert parallelism)"
            )
        slots_needed: dict[str, set[tuple[int, str]]] = {}
        if callable(local):
            for prefix, _, expert, shard in mapping.per_expert:
                if local(expert) != -1:
                    slots_needed.setdefault(prefix, set()).add((expert, shard))
        sources: dict[str, list[str]] = {}
        slots: dict[str, set[tuple[int, str]]] = {}
        prefix_of: dict[str, str] = {}
        for name, names in by_vllm_name.items():
            if not name.startswith(f"{layer}."):
                continue
            matches = [entry for entry in mapping.per_expert if entry[1] in name]
            if not matches:
                if any(entry[1] in name for entry in mapping.fused):
                    found.covered.update(names)
                    found.not_comparable.add("expert tensors sent already stacked (one tensor for all experts)")
                    comparable = False
                continue
            found.covered.update(names)
            for prefix, checkpoint_name, expert, shard in matches:
                if not callable(local) or local(expert) == -1:  # another expert-parallel worker's expert
                    continue
                held_as = mapping.parameter(name, checkpoint_name, prefix).removeprefix(holder)
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
            pending.add(name, parameter, positions=False)
            sharded = tensor_parallel_size > 1 and parameter.numel() < expected[0]
            found.entries[name] = {"expected": expected, "sharded": sharded}
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
    shard_group: tuple[int, int] = (0, 0),
) -> dict[str, Any]:
    """For each parameter this worker can read: its checksum (``held``) and the sum of its sources' checksums as
    received, rounded to its dtype (``expected``); whether it is a shard; the parameters not compared; received
    tensors that no parameter holds; and the fused expert parameters held and compared (``experts``:
    :meth:`ExpertReport.summary`). The same on every device: a parameter the engine emptied (vLLM's CPU build keeps
    its linear layers' weights in its kernels' state) is counted as not compared, a received tensor that no
    parameter holds is named. ``shard_group``: this worker's (data-parallel, pipeline) ranks; the shards of one
    parameter are summed over the ``tensor_parallel_size`` workers of one group."""
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
    pending = PendingChecksums()  # every compared parameter's checksum, read to the host at once
    experts = expert_report(model, received, by_vllm_name, engine_dtype, tensor_parallel_size, pending)
    entries: dict[str, dict[str, Any]] = dict(experts.entries)
    unchecked: list[str] = [*sorted(dropped), *experts.unchecked]
    covered: set[str] = set(dropped) | experts.covered
    for module_name, module in model.named_modules():
        overlapping = tensor_parallel_size > 1 and getattr(module, "num_kv_head_replicas", 1) > 1
        for parameter_name, parameter in module.named_parameters(recurse=False):
            name = f"{module_name}.{parameter_name}" if module_name else parameter_name
            if name in experts.handled:
                continue
            as_sent = name.replace(LORA_BASE_LAYER, "")  # a LoRA layer's base weight, as the trainer names it
            sources = sources_of(as_sent, by_vllm_name, mapping)
            covered.update(sources or by_vllm_name.get(as_sent, []))
            as_held = [received[source].held_in(parameter.dtype, engine_dtype) for source in sources or []]
            if parameter.numel() == 0 or overlapping or not sources or None in as_held:
                unchecked.append(name)
                continue
            expected = sums(checksum for checksum in as_held if checksum is not None)
            pending.add(name, parameter, positions=False)
            sharded = tensor_parallel_size > 1 and parameter.numel() < expected[0]  # without TP, fewer is a short load
            entries[name] = {"expected": expected, "sharded": sharded}
    modules = dict(model.named_modules())
    packed_into = {source: packed for packed, sources in mapping.items() for source in sources}
    for name in sorted(set(received) - covered):
        parts = [packed_into.get(part, part) for part in (vllm_name(model, name) or name).split(".")]
        # fused experts without an expert mapping to read (counted; where the layer has one, a name it does not
        # match is loaded by nothing)
        held_elsewhere = fused_experts_on_path(modules, parts)
        if held_elsewhere and held_elsewhere not in experts.layers:
            covered.add(name)
            if held_elsewhere not in unchecked:
                unchecked.append(held_elsewhere)
    buffers = {name.replace(LORA_BASE_LAYER, "") for name, _ in model.named_buffers()}
    not_held = sorted(
        name
        for name in set(received) - covered
        if not name.endswith(NEVER_HELD_SUFFIXES)
        and vllm_name(model, name) not in buffers
        and not (tied_embeddings and name.startswith("lm_head."))
    )
    held = pending.resolve()
    for name, entry in entries.items():
        entry["held"] = held[name]
    return {
        "entries": entries,
        "unchecked": unchecked,
        "not_held": not_held,
        "experts": experts.summary(),
        **parallel,
    }


def base_kept(loaded: dict[str, Any] | None) -> dict[str, list[float]]:
    """From a full load's report (:func:`loaded_report`), what to re-check later: every compared parameter's
    checksum (``tensor_checksum(parameter, positions=False)``) as held right after the load."""
    return {name: entry["held"] for name, entry in (loaded or {}).get("entries", {}).items()}


def recheck_held(model: Any, kept: dict[str, list[float]]) -> dict[str, Any]:
    """Each kept parameter's checksum now against the one kept (:func:`base_kept`; weight_sync/checksums.py,
    ``recheck_kept``): under LoRA the base is sent once, and the engine sleeps and wakes between updates (verl's
    vLLM server: level 1, the weights copied to host memory and back), so a wake that restores them wrong would go
    unseen by the adapter's own check."""
    return recheck_kept(dict(model.named_parameters(remove_duplicate=False)), kept)  # a tied lm_head by its name too
