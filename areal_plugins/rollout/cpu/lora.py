"""The LoRA adapter the CPU engine serves: peft's LoRA layers in the transformers model, the trainer's adapter
tensors loaded into them, and what each holds after loading (docs/design.md, LoRA).

verl 0.9.1 trains LoRA with peft (``get_peft_model`` with ``actor_rollout_ref.model.lora_rank``, ``lora_alpha``,
``target_modules``) and, with ``model.lora.merge: false``, sends the rollout the adapter only: peft's
``get_peft_model_state_dict`` of the trainer's ``PeftModel`` (names ``base_model.model.<module>.lora_A.weight`` and
``.lora_B.weight``) with the adapter's ``peft_config.to_dict()``. Once per trainer process it first sends the base
weights (verl's ``base_sync_done`` is false while ``rollout.load_format`` is ``dummy``), the LoRA-wrapped modules'
under ``<module>.base_layer.weight`` (verl's ``replace_lora_wrapper``).

The engine keeps the base model as it is and injects peft's LoRA layers into it (``inject_adapter_in_model``, from the
sent ``peft_config``), so its forward pass is peft's own: ``W x + (lora_alpha / r) B A x``, the adapter unmerged (LoRA,
arXiv 2106.09685, eq. 3). Each adapter update loads the tensors into those layers with peft's
``set_peft_model_state_dict``; the base weights are never written by it. What the layers hold is read back whole and
unscaled (peft applies the scaling in the forward pass), under the trainer's names, for the per-update check
(weight_sync/adapter_check.py). The base weights, sent once, are re-checked on each adapter update against their
checksums kept right after the last full load (:func:`keep_base`, :func:`recheck_base`: the same re-check verl's
vLLM path runs).

Imports neither Ray nor verl.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import torch

#: The adapter's name inside the engine (peft's default, the one verl's trainer uses).
ADAPTER_NAME = "default"
#: What peft's ``get_peft_model_state_dict`` of a ``PeftModel`` puts before a module's path (verl sends these names).
PEFT_PREFIX = "base_model.model."
#: A LoRA parameter of an injected layer, as the engine's model names it (``<module>.lora_A.default.weight``).
_HELD = re.compile(rf"^(?P<module>.+)\.(?P<part>lora_A|lora_B)\.{ADAPTER_NAME}\.weight$")
#: The parts of a peft config that decide which layers exist and what they compute: a later update with other values
#: would need other layers.
SHAPE_FIELDS = ("r", "lora_alpha", "target_modules", "use_rslora", "rank_pattern", "alpha_pattern", "fan_in_fan_out")
#: peft LoRA variants with tensors or computations the engine does not report (each would go unchecked).
UNSUPPORTED_FIELDS = {
    "use_dora": "DoRA's magnitude vectors",
    "modules_to_save": "whole modules trained beside the adapter",
    "trainable_token_indices": "trained token embeddings",
    "target_parameters": "LoRA on bare parameters",
    "lora_bias": "LoRA biases",
    "layer_replication": "replicated layers",
}


def lora_config(peft_config: dict[str, Any]) -> Any:
    """peft's ``LoraConfig`` of the ``peft_config`` dictionary verl sends (``LoraConfig.to_dict()``).

    Raises:
        ValueError: a peft type other than LoRA, or a LoRA variant the engine's check would not cover.
    """
    from peft import LoraConfig

    peft_type = str(getattr(peft_config.get("peft_type"), "value", peft_config.get("peft_type") or "LORA"))
    if peft_type != "LORA":
        raise ValueError(
            f"the areal_cpu engine serves LoRA adapters, and the trainer sent a {peft_type} adapter: set "
            "actor_rollout_ref.model.lora_rank=0 for full fine-tuning"
        )
    for key, what in UNSUPPORTED_FIELDS.items():
        if peft_config.get(key):
            raise ValueError(
                f"the trainer's LoRA adapter has {key}={peft_config[key]!r} ({what}), which the areal_cpu engine does "
                "not load or check: train a plain LoRA adapter (verl's FSDP engine builds one from "
                "actor_rollout_ref.model.lora_rank, lora_alpha and target_modules)"
            )
    fields = {field.name for field in dataclasses.fields(LoraConfig)}
    kwargs = {key: value for key, value in peft_config.items() if key in fields and key != "peft_type"}
    kwargs["inference_mode"] = True
    kwargs["lora_dropout"] = 0.0  # serving: dropout is a training-time operation
    return LoraConfig(**kwargs)


def shape_of(config: Any) -> dict[str, Any]:
    """The fields of a ``LoraConfig`` that decide the engine's LoRA layers (target modules as a sorted list)."""
    shape = {name: getattr(config, name) for name in SHAPE_FIELDS}
    targets = shape["target_modules"]
    shape["target_modules"] = targets if isinstance(targets, str) else sorted(targets or ())
    return shape


def inject(model: torch.nn.Module, config: Any) -> None:
    """Wrap ``model``'s target modules in peft's LoRA layers, in place; the base weights stay the same tensors."""
    from peft import inject_adapter_in_model

    inject_adapter_in_model(config, model, adapter_name=ADAPTER_NAME)


def load_adapter(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> list[str]:
    """Load the trainer's adapter tensors into ``model``'s LoRA layers with peft's own loader; the names it could
    not place (the per-update check names them). A tensor of another shape than its layer's is left out, so that
    the engine keeps serving and the check names it."""
    from peft import set_peft_model_state_dict

    result: Any = set_peft_model_state_dict(model, tensors, adapter_name=ADAPTER_NAME, ignore_mismatched_sizes=True)
    return list(result.unexpected_keys)


def held_adapter(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every LoRA tensor ``model`` holds, under the name the trainer sends it by
    (``base_model.model.<module>.lora_A.weight``); empty before an adapter was injected."""
    held = {}
    for name, parameter in model.named_parameters():
        found = _HELD.match(name)
        if found:
            held[f"{PEFT_PREFIX}{found['module']}.{found['part']}.weight"] = parameter.detach()
    return held


def is_adapter_parameter(name: str) -> bool:
    """Whether an engine parameter name is one of a LoRA layer's (not a base weight)."""
    return ".lora_A." in name or ".lora_B." in name or ".lora_embedding_" in name


def base_name(name: str) -> str:
    """A base weight's plain name: the model's own (verl's base sync and a LoRA-wrapped layer say ``.base_layer``)."""
    return name.replace(".base_layer.", ".")


def base_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``model``'s base parameters (every parameter but a LoRA layer's), under their plain names (:func:`base_name`;
    a tied ``lm_head`` under its own name too)."""
    return {
        base_name(name): parameter.detach()
        for name, parameter in model.named_parameters(remove_duplicate=False)
        if not is_adapter_parameter(name)
    }


def keep_base(model: torch.nn.Module) -> dict[str, list[float]]:
    """The base weights' checksums right after a load (``held_sums``, one host read): under LoRA verl sends the base
    once, then only adapters, so each adapter update re-checks the base against these (:func:`recheck_base`)."""
    from areal_plugins.weight_sync.checksums import held_sums

    return held_sums(base_weights(model))


def recheck_base(model: torch.nn.Module, kept: dict[str, list[float]]) -> dict[str, Any]:
    """The base weights now against ``kept`` (:func:`keep_base`): the shared re-check (weight_sync/checksums.py,
    ``recheck_kept``) that verl's vLLM path runs too, read by ``check_base_rechecks`` (weight_sync/adapter_check.py).
    An adapter update that wrote a base weight, or anything else that changed one since its load, is named."""
    from areal_plugins.weight_sync.checksums import recheck_kept

    return recheck_kept(base_weights(model), kept)


def adapter_report(received: dict[str, torch.Tensor], held: dict[str, torch.Tensor], replica: int) -> dict[str, Any]:
    """The engine's one rank's report for :func:`~areal_plugins.weight_sync.adapter_check.check_adapter_reports`.

    For every tensor that arrived (by the name it arrived under): its checksum as it arrived (``received``), and that
    of what the engine's LoRA layer of that name holds after loading (``held``; no values where no layer has the
    name), with ``expected`` (what arrived, in the layer's dtype) where the load casts it. Tensors the engine holds
    that did not arrive are left out: the check names each as one that never arrived."""
    from areal_plugins.weight_sync.checksums import tensor_checksum

    entries: dict[str, dict[str, list[float]]] = {}
    for name, tensor in received.items():
        entry = {"received": tensor_checksum(tensor)}
        kept = held.get(name)
        if kept is None:
            entry["held"] = [0.0, 0.0, 0.0, 0.0]
        else:
            entry["held"] = tensor_checksum(kept)
            if kept.dtype != tensor.dtype:
                entry["expected"] = tensor_checksum(tensor, as_dtype=kept.dtype)
        entries[name] = entry
    return {"replica": replica, "rank": 0, "tensor_parallel_size": 1, "adapter": entries or None}
