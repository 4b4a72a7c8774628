"""Host synchronisations of a vLLM worker's checks per update, at Qwen3-30B-A3B's tensor count (issue 59, item 4).

On a GPU every host read of a device value (``.tolist()``, ``.item()``, ``.cpu()``, ``float(t)``) waits for the
device. Emulated on the CPU: a stand-in of vLLM's Qwen3-MoE layout at 30B-A3B's counts, with tiny tensors, and every
such read counted while the worker's checks (rollout/verl_vllm/loaded_weights.py, loaded_adapter.py) run.

The counts, by hand from Qwen3-30B-A3B's config (48 layers, 128 experts, untied ``lm_head``, q/k norms):

* what verl sends: per layer ``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``, ``q_norm``, ``k_norm``, the two layer
  norms and the router ``mlp.gate`` (9) plus 128 experts x 3 projections (384): 48 x 393 = 18,864, with
  ``embed_tokens``, ``norm`` and ``lm_head``: 18,867 tensors;
* what vLLM holds: per layer ``qkv_proj``, ``o_proj``, ``q_norm``, ``k_norm``, the two norms, ``gate``, ``w13_weight``
  and ``w2_weight`` (9): 48 x 9 + 3 = 435 parameters.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from areal_plugins.rollout.verl_vllm import loaded_adapter, loaded_weights
from areal_plugins.weight_sync.checksums import check_loaded_reports

LAYERS, EXPERTS = 48, 128
TENSORS_SENT = LAYERS * (9 + EXPERTS * 3) + 3
PARAMETERS_HELD = LAYERS * 9 + 3
HIDDEN = 2
DENSE = ("o_proj", "q_norm", "k_norm")
NORMS = ("input_layernorm", "post_attention_layernorm")
PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def test_the_counts_are_30b_a3b():
    assert (TENSORS_SENT, PARAMETERS_HELD) == (18_867, 435)


def sent_tensors(dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """What verl's trainer sends of the stand-in (float32: verl's FSDP actor sends its float32 master weights)."""
    generator = torch.Generator().manual_seed(0)

    def values(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(dtype)

    sent = {"model.embed_tokens.weight": values(4, HIDDEN), "model.norm.weight": values(HIDDEN)}
    for layer in range(LAYERS):
        prefix = f"model.layers.{layer}"
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            sent[f"{prefix}.self_attn.{name}.weight"] = values(HIDDEN, HIDDEN)
        for name in ("q_norm", "k_norm"):
            sent[f"{prefix}.self_attn.{name}.weight"] = values(HIDDEN)
        for name in NORMS:
            sent[f"{prefix}.{name}.weight"] = values(HIDDEN)
        sent[f"{prefix}.mlp.gate.weight"] = values(EXPERTS, HIDDEN)
        for expert in range(EXPERTS):
            for name in PROJECTIONS:
                sent[f"{prefix}.mlp.experts.{expert}.{name}.weight"] = (
                    values(1, HIDDEN) if name != "down_proj" else (values(HIDDEN, 1))
                )
    sent["lm_head.weight"] = values(4, HIDDEN)
    return sent


class Holder(nn.Module):
    def __init__(self, **parameters: torch.Tensor) -> None:
        super().__init__()
        for name, value in parameters.items():
            self.register_parameter(name, nn.Parameter(value.to(torch.bfloat16), requires_grad=False))


class RoutedExperts(Holder):
    """vLLM 0.30's fused experts of one layer: every expert's gate then up rows in ``w13_weight``, ``w2_weight``,
    and the layer's own expert mapping (``RoutedExperts.get_expert_mapping``)."""

    def __init__(self, layer_name: str, sent: dict[str, torch.Tensor]) -> None:
        rows = [sent[f"{layer_name}.{e}.gate_proj.weight"] for e in range(EXPERTS)]
        up = [sent[f"{layer_name}.{e}.up_proj.weight"] for e in range(EXPERTS)]
        super().__init__(
            w13_weight=torch.stack([torch.cat([g, u]) for g, u in zip(rows, up, strict=True)]),
            w2_weight=torch.stack([sent[f"{layer_name}.{e}.down_proj.weight"] for e in range(EXPERTS)]),
        )
        self.layer_name = layer_name
        self.moe_config = SimpleNamespace(moe_parallel_config=SimpleNamespace(tp_size=1))

    def _map_global_expert_id_to_local_expert_id(self, expert: int) -> int:
        return expert

    def get_expert_mapping(self, include_fused: bool = False) -> list[tuple[str, str, int, str]]:
        shards = (("w1", "gate_proj"), ("w2", "down_proj"), ("w3", "up_proj"))
        return [
            ("experts.w2_" if shard == "w2" else "experts.w13_", f"experts.{expert}.{name}.", expert, shard)
            for expert in range(EXPERTS)
            for shard, name in shards
        ]


class MoERunner(nn.Module):
    """vLLM's fused MoE layer (``mlp.experts``) above the routed experts."""


def engine_model(sent: dict[str, torch.Tensor]) -> nn.Module:
    """vLLM's layout of ``sent`` on one worker (bfloat16, tensor parallel 1)."""
    model = nn.Module()
    model.packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}
    model.model = nn.Module()
    model.model.embed_tokens = Holder(weight=sent["model.embed_tokens.weight"])
    layers = []
    for index in range(LAYERS):
        prefix = f"model.layers.{index}"
        layer = nn.Module()
        layer.self_attn = nn.Module()
        qkv = torch.cat([sent[f"{prefix}.self_attn.{p}_proj.weight"] for p in "qkv"])
        layer.self_attn.qkv_proj = Holder(weight=qkv)
        for name in DENSE:
            setattr(layer.self_attn, name, Holder(weight=sent[f"{prefix}.self_attn.{name}.weight"]))
        for name in NORMS:
            setattr(layer, name, Holder(weight=sent[f"{prefix}.{name}.weight"]))
        layer.mlp = nn.Module()
        layer.mlp.gate = Holder(weight=sent[f"{prefix}.mlp.gate.weight"])
        layer.mlp.experts = MoERunner()
        layer.mlp.experts.routed_experts = RoutedExperts(f"{prefix}.mlp.experts", sent)
        layers.append(layer)
    model.model.layers = nn.ModuleList(layers)
    model.model.norm = Holder(weight=sent["model.norm.weight"])
    model.lm_head = Holder(weight=sent["lm_head.weight"])
    return model


@contextmanager
def host_reads() -> Iterator[list[str]]:
    """Every host read of a tensor's values made inside, by the method that made it."""
    reads: list[str] = []
    patch = pytest.MonkeyPatch()
    for method in ("tolist", "item", "cpu", "numpy", "__float__", "__int__", "__bool__"):
        original = getattr(torch.Tensor, method)

        def counted(self, *args, _original=original, _method=method, **kwargs):
            reads.append(_method)
            return _original(self, *args, **kwargs)

        patch.setattr(torch.Tensor, method, counted)
    try:
        yield reads
    finally:
        patch.undo()


def test_a_full_update_reads_the_device_twice_not_once_or_twice_per_tensor():
    """What a worker does in one full update (worker_extension.py): each tensor checksummed as it arrives, then
    every parameter after loading. Before (per tensor and parameter): 2 x 18,867 + 435 = 38,169 reads here (float32
    sent to a bfloat16 engine: a checksum and its rounding per tensor); now one for what arrived, one after loading."""
    sent = sent_tensors()
    model = engine_model(sent)
    with host_reads() as reads:
        arriving = loaded_weights.ReceivedChecksums(torch.bfloat16)
        for name, tensor in sent.items():
            arriving.add(name, tensor)
        received = arriving.resolve()
        assert len(reads) == 1
        report = loaded_weights.loaded_report(
            model, received, torch.bfloat16, 1, quantized=False, tied_embeddings=False
        )
    assert reads == ["tolist", "tolist"]
    assert check_loaded_reports([{"rank": 0, "loaded": report}], "r")["loaded_compared"] == PARAMETERS_HELD
    assert len(received) == TENSORS_SENT and all(r.rounded is not None for r in received.values())


def test_an_adapter_update_reads_the_device_three_times():
    """An adapter-only update (LoRA on q, k, v and o: 48 x 4 x 2 = 384 tensors): what arrived, the adapter's slots
    against it, and the base re-checked against what was kept from its load. Before: 2 x 384 on arrival, 2 x 384
    for the slots (expected and held), 435 for the base: 1,971."""
    sent = sent_tensors()
    model = engine_model(sent)
    received = {name: loaded_weights.ReceivedTensor.of(tensor, torch.bfloat16) for name, tensor in sent.items()}
    kept = loaded_weights.base_kept(
        loaded_weights.loaded_report(model, received, torch.bfloat16, 1, quantized=False, tied_embeddings=False)
    )
    generator = torch.Generator().manual_seed(1)
    adapter = {}
    for layer in range(LAYERS):
        for module in ("q_proj", "k_proj", "v_proj", "o_proj"):
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            adapter[f"{prefix}.lora_A.weight"] = torch.randn(4, HIDDEN, generator=generator)
            adapter[f"{prefix}.lora_B.weight"] = torch.randn(HIDDEN, 4, generator=generator)
    scaling = 2.0
    held = {  # the engine's slots as vLLM fills them: the adapter's dtype, lora_B scaled
        name: (
            (t.to(torch.bfloat16) * (1.0 if ".lora_A." in name else scaling)),
            torch.bfloat16,
            ".lora_A." in name,
            lambda tensor: tensor,
        )
        for name, t in adapter.items()
    }
    with host_reads() as reads:
        arriving = loaded_weights.ReceivedChecksums(torch.bfloat16)
        for name, tensor in adapter.items():
            arriving.add(name, tensor)
        checksums = {name: r.checksum for name, r in arriving.resolve().items()}
        entries = loaded_adapter.adapter_report(held, adapter, checksums, scaling)
        recheck = loaded_weights.recheck_held(model, kept)
    assert reads == ["tolist"] * 3
    assert len(entries) == 2 * 4 * LAYERS and all(e["expected"] == e["held"] for e in entries.values())
    assert recheck == {"compared": PARAMETERS_HELD, "changed": 0, "changed_names": []}
