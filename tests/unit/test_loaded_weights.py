"""The check of what a vLLM worker holds after loading against what it received (rollout/verl_vllm/loaded_weights.py).

The engine's layout is built here the way vLLM builds it, independently of the code under test: ``qkv_proj`` is
``q``, ``k`` and ``v`` concatenated, ``gate_up_proj`` likewise, the embedding padded with zero rows, and under
tensor parallelism each worker holds a row block of the sharded parameters and a full copy of the others.
"""

from __future__ import annotations

from types import SimpleNamespace

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
    replaced = engine_model(sent)  # a module without the parameter: on every device, nothing holds what was sent
    del replaced.model.layers[0].mlp.gate_up_proj.weight
    not_held = r"2 tensors that no engine parameter holds .* e.g. model.layers.0.mlp.gate_"
    with pytest.raises(WeightSyncError, match=not_held):
        check_loaded_reports([report(replaced, sent)], "r")
    del replaced.model.layers[0].mlp.gate_up_proj  # no module to hold gate_proj and up_proj at all
    with pytest.raises(WeightSyncError, match=not_held):
        check_loaded_reports([report(replaced, sent)], "r")
    quantized = report(engine_model(sent), sent, quantized=True)
    assert check_loaded_reports([quantized], "r") == {"loaded_compared": 0, "loaded_not_compared": "quantized weights"}


class LinearWithLoRA(nn.Module):
    """vLLM's LoRA wrapper of a linear layer: the base weight under ``base_layer.`` (``qkv_proj.base_layer.weight``)."""

    def __init__(self, base_layer: nn.Module) -> None:
        super().__init__()
        self.base_layer = base_layer


def with_lora(model: nn.Module, empty: bool = False) -> nn.Module:
    """``model`` with its packed linear layers wrapped for LoRA as vLLM wraps them (``empty``: their base weights in
    the CPU build's kernels, the parameter left empty)."""
    layer = model.model.layers[0]
    for parent, name in ((layer.self_attn, "qkv_proj"), (layer.mlp, "gate_up_proj")):
        base = getattr(parent, name)
        if empty:
            base.weight = nn.Parameter(torch.empty(0), requires_grad=False)
        setattr(parent, name, LinearWithLoRA(base))
    return model


def test_lora_base_weights_are_compared_under_vllms_base_layer_names_as_verl_sends_them_or_as_peft_names_them():
    """verl 0.9.1's FSDP engine sends LoRA's base weights without peft's ``.base_layer`` (``fsdp_utils.py``,
    ``.replace(".base_layer", "")``); vLLM holds them under it. Both namings are the same parameters on any device."""
    sent = trainer_tensors()
    compared = check_loaded_reports([report(with_lora(engine_model(sent)), sent)], "r")
    assert counted(compared) == (4, 0)
    peft_named = {
        name.replace(".weight", ".base_layer.weight") if "_proj" in name else name: t for name, t in sent.items()
    }
    assert counted(check_loaded_reports([report(with_lora(engine_model(sent)), peft_named)], "r")) == (4, 0)
    model = with_lora(engine_model(sent))
    with torch.no_grad():
        model.model.layers[0].self_attn.qkv_proj.base_layer.weight.view(-1)[5] += 1.0
    with pytest.raises(WeightSyncError, match=r"parameter model.layers.0.self_attn.qkv_proj.base_layer.weight holds"):
        check_loaded_reports([report(model, sent)], "r")
    on_cpu = with_lora(engine_model(sent), empty=True)  # the CPU build: counted, not compared, and not "held by none"
    compared = check_loaded_reports([report(on_cpu, sent)], "r")
    assert counted(compared) == (2, 2)
    assert compared["loaded_not_compared_examples"] == [
        "model.layers.0.mlp.gate_up_proj.base_layer.weight",
        "model.layers.0.self_attn.qkv_proj.base_layer.weight",
    ]


EXPERTS, HIDDEN, INTERMEDIATE = 3, 4, 2
#: vLLM's expert checkpoint names and the shard each loads into (``build_expert_params_mapping``, both versions).
EXPERT_SHARDS = (("w1", "gate_proj"), ("w2", "down_proj"), ("w3", "up_proj"))


def expert_mapping(
    parameter_prefix: str, lora: str = "", lora_on_parameter: str = ""
) -> list[tuple[str, str, int, str]]:
    """vLLM's per-expert mapping, ``(parameter prefix, checkpoint name, expert, shard)``: ``parameter_prefix`` is
    ``experts.`` on the expert layer (vLLM 0.30, ``RoutedExperts.get_expert_mapping``: names under the layer) or
    ``experts.routed_experts.`` on the model (vLLM 0.24.0, ``Qwen2MoeModel.get_expert_mapping``: the model's names).
    Under LoRA vLLM adds ``base_layer.`` to the checkpoint names (``lora``), 0.24.0 to the parameter's too."""
    return [
        (
            f"{parameter_prefix}{lora_on_parameter}{'w2_' if shard == 'w2' else 'w13_'}",
            f"experts.{expert}.{name}.{lora}",
            expert,
            shard,
        )
        for expert in range(EXPERTS)
        for shard, name in EXPERT_SHARDS
    ]


def expert_tensors(seed: int = 1) -> dict[str, torch.Tensor]:
    """What verl's trainer sends of layer 0's experts: one tensor per expert and projection."""
    generator = torch.Generator().manual_seed(seed)
    shapes = {
        "gate_proj": (INTERMEDIATE, HIDDEN),
        "up_proj": (INTERMEDIATE, HIDDEN),
        "down_proj": (HIDDEN, INTERMEDIATE),
    }
    return {
        f"model.layers.0.mlp.experts.{expert}.{name}.weight": torch.randn(*shape, generator=generator).to(
            torch.bfloat16
        )
        for expert in range(EXPERTS)
        for name, shape in shapes.items()
    }


class MoERunner(nn.Module):
    """vLLM's fused MoE layer (``mlp.experts``): router, shared experts and the routed experts below it."""


class RoutedExperts(Holder):
    """vLLM's routed experts as vLLM 0.24.0 builds them: ``w13_weight`` (each expert's gate rows, then its up rows)
    and ``w2_weight``, this worker's experts only, and no expert mapping of its own."""

    def __init__(self, layer_name: str, sent: dict[str, torch.Tensor], local_experts: int = EXPERTS) -> None:
        prefix = f"{layer_name}."
        super().__init__(
            w13_weight=torch.stack(
                [
                    torch.cat([sent[f"{prefix}{e}.gate_proj.weight"], sent[f"{prefix}{e}.up_proj.weight"]])
                    for e in range(local_experts)
                ]
            ),
            w2_weight=torch.stack([sent[f"{prefix}{e}.down_proj.weight"] for e in range(local_experts)]),
        )
        self.layer_name = layer_name
        self.local_experts = local_experts
        self.moe_config = SimpleNamespace(moe_parallel_config=SimpleNamespace(tp_size=1))

    def _map_global_expert_id_to_local_expert_id(self, expert: int) -> int:
        return expert if expert < self.local_experts else -1


class RoutedExpertsWithMapping(RoutedExperts):
    """vLLM 0.30's: the expert mapping is the layer's own, its parameter names relative to the layer."""

    lora = ""  # "base_layer." once vLLM wraps the layer for LoRA

    def get_expert_mapping(self, include_fused: bool = False) -> list[tuple[str, str, int, str]]:
        return expert_mapping("experts.", self.lora)


class Qwen2MoeModel(nn.Module):
    """vLLM 0.24.0's model class: the expert mapping is the model's, its parameter names the model's own."""

    def get_expert_mapping(self) -> list[tuple[str, str, int, str]]:
        lora = "base_layer." if any(".base_layer." in name for name, _ in self.named_parameters()) else ""
        return expert_mapping("experts.routed_experts.", lora, lora)


def moe_engine_model(
    sent: dict[str, torch.Tensor],
    layer: type[RoutedExperts],
    model_class: type[nn.Module] = nn.Module,
    local_experts: int = EXPERTS,
) -> nn.Module:
    """:func:`engine_model` with layer 0's experts fused as vLLM fuses them, under ``mlp.experts.routed_experts``."""
    model = engine_model(sent)
    inner = model_class()
    for name, child in model.model.named_children():
        inner.add_module(name, child)
    model.model = inner
    runner = MoERunner()
    runner.routed_experts = layer("model.layers.0.mlp.experts", sent, local_experts)
    model.model.layers[0].mlp.experts = runner
    return model


def with_moe_lora(model: nn.Module) -> nn.Module:
    """``model`` with its MoE layer wrapped for LoRA as vLLM wraps it (``FusedMoEWithLoRA(base_layer=MoERunner)``):
    the experts' parameters under ``mlp.experts.base_layer.routed_experts``."""
    mlp = model.model.layers[0].mlp
    mlp.experts = LinearWithLoRA(mlp.experts)
    mlp.experts.base_layer.routed_experts.lora = "base_layer."
    return with_lora(model)


EXPERT_LAYER = "model.layers.0.mlp.experts.routed_experts"
VLLM_TREES = {  # the expert mapping where each vLLM version has it
    "vLLM 0.30: on the expert layer": (RoutedExpertsWithMapping, nn.Module),
    "vLLM 0.24.0: on the model": (RoutedExperts, Qwen2MoeModel),
}


@pytest.mark.parametrize("tree", VLLM_TREES)
def test_every_fused_expert_parameter_is_compared_wherever_vllm_keeps_its_expert_mapping(tree):
    sent = {**trainer_tensors(), **expert_tensors()}
    model = moe_engine_model(sent, *VLLM_TREES[tree])
    compared = check_loaded_reports([report(model, sent)], "r")
    assert counted(compared) == (6, 0)  # embed_tokens, qkv_proj, gate_up_proj, norm, w13_weight, w2_weight
    with torch.no_grad():
        model.get_submodule(EXPERT_LAYER).w13_weight[2, 3, 1] += 1.0  # expert 2's up projection
    with pytest.raises(WeightSyncError, match=rf"parameter {EXPERT_LAYER}.w13_weight holds after loading something"):
        check_loaded_reports([report(model, sent)], "r")


@pytest.mark.parametrize("tree", VLLM_TREES)
def test_expert_parameters_under_lora_are_compared_with_the_base_weights_verl_sends(tree):
    """verl 0.9.1 sends LoRA's base expert weights without ``base_layer.``; vLLM's mapping names them with it."""
    sent = {**trainer_tensors(), **expert_tensors()}
    model = with_moe_lora(moe_engine_model(sent, *VLLM_TREES[tree]))
    assert counted(check_loaded_reports([report(model, sent)], "r")) == (6, 0)
    with torch.no_grad():
        model.get_submodule(EXPERT_LAYER.replace(".experts.", ".experts.base_layer.")).w2_weight[0, 0, 0] += 1.0
    with pytest.raises(WeightSyncError, match=r"parameter model.layers.0.mlp.experts.base_layer.routed_experts.w2_"):
        check_loaded_reports([report(model, sent)], "r")


@pytest.mark.parametrize("tree", VLLM_TREES)
def test_an_expert_tensor_the_mapping_loads_into_nothing_is_named(tree):
    sent = {**trainer_tensors(), **expert_tensors()}
    model = moe_engine_model(sent, *VLLM_TREES[tree])
    sent["model.layers.0.mlp.experts.3.down_proj.weight"] = sent.pop("model.layers.0.mlp.experts.2.down_proj.weight")
    with pytest.raises(WeightSyncError, match=r"no engine parameter holds after loading, e.g. .*experts\.3\.down_proj"):
        check_loaded_reports([report(model, sent)], "r")


@pytest.mark.parametrize("tree", VLLM_TREES)
def test_under_expert_parallelism_each_worker_compares_its_own_experts(tree):
    sent = {**trainer_tensors(), **expert_tensors()}
    layer, model_class = VLLM_TREES[tree]
    model = moe_engine_model(sent, layer, model_class, local_experts=2)  # expert 2 lives on another worker
    assert counted(check_loaded_reports([report(model, sent)], "r")) == (6, 0)


def test_fused_experts_without_an_expert_mapping_stop_the_update_naming_what_it_expected():
    """No expert mapping on the layer or the model: nothing tells which sent tensor went into which expert's slot.
    Counting the expert parameters as not compared would pass every expert load unchecked."""
    sent = {**trainer_tensors(), **expert_tensors()}
    model = moe_engine_model(sent, RoutedExperts)
    with pytest.raises(
        WeightSyncError,
        match=rf"hold 2 fused expert parameters \(w13_weight/w2_weight, e.g. {EXPERT_LAYER}.w13_weight\), and "
        r"the after-load check compared none of them: .*get_expert_mapping",
    ):
        check_loaded_reports([report(model, sent)], "r")


def test_an_update_of_which_no_parameter_could_be_compared_stops_it():
    sent = trainer_tensors()
    model = engine_model(sent)
    for module in model.modules():  # the CPU build keeps every linear weight in its kernels' state: empty parameters
        for name, _ in list(module.named_parameters(recurse=False)):
            setattr(module, name, nn.Parameter(torch.empty(0), requires_grad=False))
    with pytest.raises(
        WeightSyncError, match=r"r: the after-load check compared none of the 4 parameters .* e.g. model"
    ):
        check_loaded_reports([report(model, sent)], "r")


def test_a_worker_without_a_loaded_report_is_refused():
    with pytest.raises(WeightSyncError, match="vLLM worker rank 0: no report of the weights it holds after loading"):
        check_loaded_reports([{"rank": 0, "loaded": None}], "replica 0")
