"""The check of what a vLLM worker holds after loading against what it received (rollout/verl_vllm/loaded_weights.py).

The engine's layout is built here the way vLLM builds it, independently of the code under test: ``qkv_proj`` is
``q``, ``k`` and ``v`` concatenated, ``gate_up_proj`` likewise, the embedding padded with zero rows, and under
tensor parallelism each worker holds a row block of the sharded parameters and a full copy of the others.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from areal_plugins.rollout.verl_vllm.loaded_weights import ReceivedTensor, loaded_report, source_names
from areal_plugins.weight_sync.checksums import check_loaded_reports
from areal_plugins.weight_sync.errors import WeightSyncError

PACKED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}


def trainer_tensors() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)

    def values(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(torch.bfloat16)

    return {
        "model.embed_tokens.weight": values(10, 4),
        "model.layers.0.self_attn.q_proj.weight": values(4, 4),
        "model.layers.0.self_attn.k_proj.weight": values(2, 4),
        "model.layers.0.self_attn.v_proj.weight": values(2, 4),
        "model.layers.0.mlp.gate_proj.weight": values(6, 4),
        "model.layers.0.mlp.up_proj.weight": values(6, 4),
        "model.norm.weight": values(4),
        "lm_head.weight": values(10, 4),
    }


class Holder(nn.Module):
    def __init__(self, **parameters: torch.Tensor) -> None:
        super().__init__()
        for name, value in parameters.items():
            self.register_parameter(name, nn.Parameter(value.clone(), requires_grad=False))


def engine_model(sent: dict[str, torch.Tensor], rank: int = 0, tp: int = 1, kv_replicas: int = 1) -> nn.Module:
    """vLLM's layout of ``sent`` as tensor-parallel rank ``rank`` of ``tp`` holds it (tied lm_head: not a parameter)."""

    def shard(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.chunk(tp, dim=0)[rank]

    embedding = torch.cat([sent["model.embed_tokens.weight"], torch.zeros(6, 4, dtype=torch.bfloat16)])  # padded
    qkv = torch.cat([sent[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv"])
    gate_up = torch.cat([sent["model.layers.0.mlp.gate_proj.weight"], sent["model.layers.0.mlp.up_proj.weight"]])
    model = nn.Module()
    model.packed_modules_mapping = PACKED
    model.model = nn.Module()
    model.model.embed_tokens = Holder(weight=shard(embedding))
    layer = nn.Module()
    layer.self_attn = nn.Module()
    layer.self_attn.qkv_proj = Holder(weight=shard(qkv))
    layer.self_attn.qkv_proj.num_kv_head_replicas = kv_replicas
    layer.mlp = nn.Module()
    layer.mlp.gate_up_proj = Holder(weight=shard(gate_up))
    model.model.layers = nn.ModuleList([layer])
    model.model.norm = Holder(weight=sent["model.norm.weight"])  # replicated on every rank
    return model


def report(model: nn.Module, sent: dict[str, torch.Tensor], rank: int = 0, tp: int = 1, **kwargs) -> dict:
    received = {name: ReceivedTensor.of(tensor, torch.bfloat16) for name, tensor in sent.items()}
    options = {"quantized": False, "tied_embeddings": True, **kwargs}
    return {"rank": rank, "loaded": loaded_report(model, received, torch.bfloat16, tp, **options)}


def counted(compared: dict) -> tuple[int, int]:
    return compared["loaded_compared"], compared["loaded_not_compared"]


def test_fused_parameters_have_the_sources_vllm_loads_into_them():
    assert source_names("model.layers.3.self_attn.qkv_proj.weight", PACKED) == [
        "model.layers.3.self_attn.q_proj.weight",
        "model.layers.3.self_attn.k_proj.weight",
        "model.layers.3.self_attn.v_proj.weight",
    ]
    assert source_names("model.norm.weight", PACKED) == ["model.norm.weight"]


def test_what_was_loaded_matches_what_was_received_fused_and_padded():
    sent = trainer_tensors()
    compared = check_loaded_reports([report(engine_model(sent), sent)], "replica 0")
    # embed_tokens, qkv_proj, gate_up_proj, norm; lm_head is tied (no parameter of its own)
    assert compared == {"loaded_compared": 4, "loaded_not_compared": 0, "loaded_not_compared_examples": []}


def test_float32_sent_to_a_bfloat16_engine_is_compared_as_the_engine_rounds_it():
    """verl may send float32 (the trainer's own dtype); vLLM rounds each value to bfloat16 as it loads, and keeps
    some parameters (biases, on CPU) in float32: both compare, against the rounded and the exact checksum."""
    exact = {name: tensor.float() + 1e-3 for name, tensor in trainer_tensors().items()}  # not bfloat16-representable
    model = engine_model({name: tensor.to(torch.bfloat16) for name, tensor in exact.items()})
    model.model.norm.weight = nn.Parameter(exact["model.norm.weight"].clone(), requires_grad=False)  # kept in float32
    assert counted(check_loaded_reports([report(model, exact)], "r")) == (4, 0)
    model.model.norm.weight = nn.Parameter(exact["model.norm.weight"].to(torch.bfloat16).float(), requires_grad=False)
    with pytest.raises(WeightSyncError, match=r"parameter model.norm.weight holds after loading"):
        check_loaded_reports([report(model, exact)], "r")  # float32, but rounded on the way: not what was sent


def test_a_value_changed_after_loading_is_named():
    sent = trainer_tensors()
    model = engine_model(sent)
    with torch.no_grad():
        model.model.layers[0].mlp.gate_up_proj.weight.view(-1)[7] += 1.0
    with pytest.raises(WeightSyncError, match=r"replica 0, vLLM worker rank 0: parameter model.layers.0.mlp.gate_up"):
        check_loaded_reports([report(model, sent)], "replica 0")


def test_a_source_loaded_into_the_wrong_place_is_named():
    """k and v swapped inside qkv_proj keep its sums: caught only where the swap changes them, so q and k here."""
    sent = trainer_tensors()
    model = engine_model(sent)
    with torch.no_grad():
        model.model.layers[0].self_attn.qkv_proj.weight[:4] = sent["model.layers.0.self_attn.k_proj.weight"].repeat(
            2, 1
        )
    with pytest.raises(WeightSyncError, match=r"parameter model.layers.0.self_attn.qkv_proj.weight holds after"):
        check_loaded_reports([report(model, sent)], "replica 0")


def test_a_received_tensor_no_parameter_holds_is_named():
    sent = trainer_tensors()
    sent["model.layers.0.mlp.gate_prj.weight"] = sent.pop("model.layers.0.mlp.gate_proj.weight")  # a bad name
    model = engine_model({**sent, "model.layers.0.mlp.gate_proj.weight": sent["model.layers.0.mlp.gate_prj.weight"]})
    with pytest.raises(
        WeightSyncError, match=r"no engine parameter holds after loading, e.g. model.layers.0.mlp.gate_prj"
    ):
        check_loaded_reports([report(model, sent)], "replica 0")


def test_an_untied_lm_head_must_be_held():
    sent = trainer_tensors()
    with pytest.raises(WeightSyncError, match=r"e.g. lm_head.weight"):
        check_loaded_reports([report(engine_model(sent), sent, tied_embeddings=False)], "replica 0")


def test_shards_are_compared_summed_over_the_replicas_workers():
    sent = trainer_tensors()
    reports = [report(engine_model(sent, rank, tp=2), sent, rank, tp=2) for rank in range(2)]
    assert counted(check_loaded_reports(reports, "replica 1")) == (4, 0)
    corrupted = engine_model(sent, 1, tp=2)
    with torch.no_grad():
        corrupted.model.embed_tokens.weight.view(-1)[0] += 1.0
    reports[1] = report(corrupted, sent, 1, tp=2)
    with pytest.raises(WeightSyncError, match=r"parameter model.embed_tokens.weight, summed over the replica's tensor"):
        check_loaded_reports(reports, "replica 1")


def test_shards_are_summed_per_data_parallel_group_each_over_all_its_tensor_parallel_workers():
    sent = trainer_tensors()
    reports = [  # two data-parallel groups of two tensor-parallel workers: each group holds the whole model once
        report(engine_model(sent, tp_rank, tp=2), sent, 2 * dp_rank + tp_rank, tp=2, shard_group=(dp_rank, 0))
        for dp_rank in range(2)
        for tp_rank in range(2)
    ]
    assert counted(check_loaded_reports(reports, "replica 0")) == (4, 0)
    reports[2]["loaded"]["entries"].pop("model.embed_tokens.weight")  # worker 2 holds no shard of it
    with pytest.raises(WeightSyncError, match=r"embed_tokens.weight is sharded, but only vLLM workers \[3\] of a"):
        check_loaded_reports(reports, "replica 0")


def test_a_whole_parameter_holding_fewer_values_than_it_received_is_a_short_load_not_a_shard():
    sent = trainer_tensors()
    model = engine_model(sent)
    short = model.model.layers[0].mlp.gate_up_proj.weight[:6]  # only gate_proj's rows: up_proj never loaded
    model.model.layers[0].mlp.gate_up_proj.weight = nn.Parameter(short.clone(), requires_grad=False)
    with pytest.raises(WeightSyncError, match=r"gate_up_proj.weight holds 24 values after loading, fewer than the 48"):
        check_loaded_reports([report(model, sent)], "replica 0")


def test_what_cannot_be_compared_is_counted_not_passed_off():
    sent = trainer_tensors()
    overlapping = [report(engine_model(sent, rank, tp=2, kv_replicas=2), sent, rank, tp=2) for rank in range(2)]
    compared = check_loaded_reports(overlapping, "r")
    assert counted(compared) == (3, 1)
    assert compared["loaded_not_compared_examples"] == ["model.layers.0.self_attn.qkv_proj.weight"]
    repacked = engine_model(sent)
    repacked.model.layers[0].mlp.gate_up_proj.weight = nn.Parameter(torch.empty(0), requires_grad=False)  # CPU build
    assert counted(check_loaded_reports([report(repacked, sent)], "r")) == (3, 1)
    replaced = engine_model(sent)  # the CPU build also moves a weight into its kernel's state: the module stays
    del replaced.model.layers[0].mlp.gate_up_proj.weight
    on_cpu = report(replaced, sent, kernels_own_weights=True)
    assert counted(check_loaded_reports([on_cpu], "r")) == (3, 1)
    not_held = r"2 tensors that no engine parameter holds .* e.g. model.layers.0.mlp.gate_"
    with pytest.raises(WeightSyncError, match=not_held):
        check_loaded_reports([report(replaced, sent)], "r")  # elsewhere a parameter must hold them
    del replaced.model.layers[0].mlp.gate_up_proj  # no module to hold gate_proj and up_proj at all
    with pytest.raises(WeightSyncError, match=not_held):
        check_loaded_reports([report(replaced, sent, kernels_own_weights=True)], "r")
    quantized = report(engine_model(sent), sent, quantized=True)
    assert check_loaded_reports([quantized], "r") == {"loaded_compared": 0, "loaded_not_compared": "quantized weights"}


class FusedMoE(Holder):
    """vLLM's fused experts: every expert's gate and up stacked into one parameter by vLLM's expert mapping."""


def test_fused_experts_are_counted_not_compared_and_not_taken_for_unknown_names():
    sent = trainer_tensors()
    experts = {f"model.layers.0.mlp.experts.{e}.{p}_proj.weight": torch.ones(6, 4) for e in range(2) for p in "gu"}
    model = engine_model(sent)
    model.model.layers[0].mlp.experts = FusedMoE(w13_weight=torch.ones(2, 12, 4))
    compared = check_loaded_reports([report(model, {**sent, **experts})], "r")
    assert counted(compared) == (4, 2)
    assert compared["loaded_not_compared_examples"] == [
        "model.layers.0.mlp.experts",
        "model.layers.0.mlp.experts.w13_weight",
    ]


def test_a_worker_without_a_loaded_report_is_refused():
    with pytest.raises(WeightSyncError, match="vLLM worker rank 0: no report of the weights it holds after loading"):
        check_loaded_reports([{"rank": 0, "loaded": None}], "replica 0")
