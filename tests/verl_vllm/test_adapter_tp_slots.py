"""The per-update LoRA adapter check under tensor parallelism, on vLLM's own LoRA layers (needs vLLM: runs in
``.venv-verl-vllm``).

No engine, no process group: for each tensor-parallel rank, vLLM's LoRA layers of one Qwen2 decoder layer
(``qkv_proj`` with q/k/v packed, ``gate_up_proj`` with gate/up packed, row-parallel ``o_proj`` and ``down_proj``) are
built over vLLM's linear layers told that rank (the tensor-parallel rank and size they ask ``parallel_state`` for
are patched). The adapter is registered as vLLM registers it (``LoRALayerWeights.optimize``,
``PackedLoRALayerWeights.pack``) and written into each rank's slot by the layer's own ``set_lora``. Each rank's report
is rollout/verl_vllm/loaded_adapter.py's, checked by weight_sync/adapter_check.py, as the worker extension and our
server adapter call them.

4 ranks, 4 query heads, 2 KV heads: each KV head is replicated on 2 ranks (``num_kv_head_replicas == 2``), so the
k/v ``lora_B`` parts of ranks 0 and 1 (and of 2 and 3) are the same rows, and do not add up to the whole tensor.
"""

from __future__ import annotations

import pytest
import torch
from vllm.config.lora import LoRAConfig
from vllm.lora.layers import (
    MergedColumnParallelLinearWithLoRA,
    MergedQKVParallelLinearWithLoRA,
    RowParallelLinearWithLoRA,
)
from vllm.lora.lora_model import LoRAModel
from vllm.lora.lora_weights import LoRALayerWeights, PackedLoRALayerWeights
from vllm.model_executor import parameter
from vllm.model_executor.layers import linear
from vllm.model_executor.models.qwen2 import Qwen2ForCausalLM

from areal_plugins.rollout.verl_vllm.loaded_adapter import VERL_LORA_INT_ID, adapter_report, corrupt_slot, held_adapter
from areal_plugins.weight_sync.adapter_check import check_adapter_reports
from areal_plugins.weight_sync.checksums import tensor_checksum
from areal_plugins.weight_sync.errors import WeightSyncError

TP = 4
HIDDEN, HEAD_SIZE, HEADS, KV_HEADS, INTERMEDIATE = 16, 4, 4, 2, 32
RANK, ALPHA = 4, 10  # vLLM scales lora_B by 2.5
LAYER = "model.layers.0"
PACKED = Qwen2ForCausalLM.packed_modules_mapping
#: module -> (input size, output size) of the trainer's (unpacked) linear layer
SHAPES = {
    "self_attn.q_proj": (HIDDEN, HEADS * HEAD_SIZE),
    "self_attn.k_proj": (HIDDEN, KV_HEADS * HEAD_SIZE),
    "self_attn.v_proj": (HIDDEN, KV_HEADS * HEAD_SIZE),
    "self_attn.o_proj": (HEADS * HEAD_SIZE, HIDDEN),
    "mlp.gate_proj": (HIDDEN, INTERMEDIATE),
    "mlp.up_proj": (HIDDEN, INTERMEDIATE),
    "mlp.down_proj": (INTERMEDIATE, HIDDEN),
}


def name(module: str, half: str) -> str:
    return f"base_model.model.{LAYER}.{module}.lora_{half}.weight"


def trainer_adapter() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    tensors = {}
    for module, (inputs, outputs) in SHAPES.items():
        tensors[name(module, "A")] = torch.randn(RANK, inputs, generator=generator)
        tensors[name(module, "B")] = torch.randn(outputs, RANK, generator=generator)
    return tensors


def registered(tensors: dict[str, torch.Tensor]) -> LoRAModel:
    """The adapter as vLLM registers it: one entry per LoRA layer, the packed ones packed, lora_B scaled."""

    def weights(module: str) -> LoRALayerWeights:
        a, b = tensors[name(module, "A")].clone(), tensors[name(module, "B")].clone()
        return LoRALayerWeights(f"{LAYER}.{module}", RANK, ALPHA, a, b)

    loras = {
        f"{LAYER}.self_attn.qkv_proj": PackedLoRALayerWeights.pack(
            [weights(f"self_attn.{sub}") for sub in PACKED["qkv_proj"]]
        ),
        f"{LAYER}.mlp.gate_up_proj": PackedLoRALayerWeights.pack(
            [weights(f"mlp.{sub}") for sub in PACKED["gate_up_proj"]]
        ),
        f"{LAYER}.self_attn.o_proj": weights("self_attn.o_proj").optimize(),
        f"{LAYER}.mlp.down_proj": weights("mlp.down_proj").optimize(),
    }
    return LoRAModel(VERL_LORA_INT_ID, RANK, loras)


class Manager:
    """vLLM's LoRA model manager as held_adapter and corrupt_slot read it: one rank's LoRA layers, the adapter in
    slot 1 of 2."""

    packed_modules_mapping = PACKED

    def __init__(self, modules: dict[str, torch.nn.Module], adapter: LoRAModel) -> None:
        self.modules = modules
        self.model = torch.nn.Module()  # no hf_to_vllm_mapper: the names are vLLM's already
        self.lora_index_to_id = [None, VERL_LORA_INT_ID]
        self.adapter = adapter

    def get_adapter(self, lora_id: int) -> LoRAModel | None:
        return self.adapter if lora_id == self.adapter.id else None


def rank_manager(monkeypatch: pytest.MonkeyPatch, tp_rank: int, adapter: LoRAModel) -> Manager:
    """Tensor-parallel rank ``tp_rank``'s LoRA layers, loaded by their own ``set_lora`` as vLLM's activation does."""
    for module in (linear, parameter):
        monkeypatch.setattr(module, "get_tensor_model_parallel_rank", lambda: tp_rank)
        monkeypatch.setattr(module, "get_tensor_model_parallel_world_size", lambda: TP)
    dtype = {"bias": False, "params_dtype": torch.float32}
    layers = {
        f"{LAYER}.self_attn.qkv_proj": MergedQKVParallelLinearWithLoRA(
            linear.QKVParallelLinear(HIDDEN, HEAD_SIZE, HEADS, KV_HEADS, **dtype)
        ),
        f"{LAYER}.self_attn.o_proj": RowParallelLinearWithLoRA(
            linear.RowParallelLinear(HEADS * HEAD_SIZE, HIDDEN, **dtype)
        ),
        f"{LAYER}.mlp.gate_up_proj": MergedColumnParallelLinearWithLoRA(
            linear.MergedColumnParallelLinear(HIDDEN, [INTERMEDIATE] * 2, **dtype)
        ),
        f"{LAYER}.mlp.down_proj": RowParallelLinearWithLoRA(linear.RowParallelLinear(INTERMEDIATE, HIDDEN, **dtype)),
    }
    config = LoRAConfig(max_lora_rank=8, max_loras=2, lora_dtype=torch.float32)
    manager = Manager(layers, adapter)
    slot = manager.lora_index_to_id.index(VERL_LORA_INT_ID)
    for module_name, layer in layers.items():
        assert layer.tp_rank == tp_rank and layer.tp_size == TP
        layer.create_lora_weights(2, config)
        weights = adapter.get_lora(module_name)
        layer.set_lora(slot, weights.lora_a, weights.lora_b)
    return manager


@pytest.fixture
def ranks(monkeypatch) -> tuple[dict[str, torch.Tensor], list[Manager]]:
    tensors = trainer_adapter()
    adapter = registered(tensors)
    return tensors, [rank_manager(monkeypatch, tp_rank, adapter) for tp_rank in range(TP)]


def checked(tensors: dict[str, torch.Tensor], managers: list[Manager]) -> dict[str, int]:
    """Each rank's report (as the worker extension makes it) and the replica's check (as our server adapter)."""
    sent = {tensor_name: tensor_checksum(tensor) for tensor_name, tensor in tensors.items()}
    reports = []
    for tp_rank, manager in enumerate(managers):
        held = held_adapter(manager, list(tensors))
        adapter = adapter_report(held, tensors, dict(sent), ALPHA / RANK)
        reports.append({"replica": 0, "rank": tp_rank, "tensor_parallel_size": TP, "adapter": adapter})
    return check_adapter_reports(sent, reports, version=1, ranks_per_replica=TP)


def test_ranks_that_share_a_kv_head_pass_an_intact_update(ranks):
    tensors, managers = ranks
    qkv = [manager.modules[f"{LAYER}.self_attn.qkv_proj"] for manager in managers]
    assert [layer.base_layer.num_kv_head_replicas for layer in qkv] == [2] * TP
    k_slots = [layer.lora_b_stacked[1][1, 0, :, :RANK] for layer in qkv]  # k_proj's lora_B part on each rank
    assert torch.equal(k_slots[0], k_slots[1]) and torch.equal(k_slots[2], k_slots[3])  # one KV head, two ranks
    assert not torch.equal(k_slots[1], k_slots[2])
    assert checked(tensors, managers) == {"adapter_tensors": 2 * len(SHAPES), "adapter_ranks": TP}


@pytest.mark.parametrize(
    ("module", "half", "tp_rank"),
    [("self_attn.k_proj", "B", 3), ("self_attn.v_proj", "B", 0), ("mlp.down_proj", "A", 1)],
)
def test_a_value_changed_in_one_ranks_slot_is_named(ranks, module, half, tp_rank):
    tensors, managers = ranks
    changed = name(module, half)
    corrupt_slot(managers[tp_rank], changed)  # the first value of that rank's part, the other ranks intact
    with pytest.raises(
        WeightSyncError,
        match=rf"rollout replica 0, engine rank {tp_rank}, update 1: adapter tensor {changed} is held as other values",
    ):
        checked(tensors, managers)
