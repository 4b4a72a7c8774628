"""Every verl name areal_plugins imports, subclasses, overrides or patches, pinned to what we rely on (issue 50).

A verl release that moves or re-signs one of them fails here, naming each, instead of at run time. The lists are
kept complete by the tests below: one reads our source (imports, patch targets), one walks our subclasses of verl's
classes for the methods we override, one checks the plugin's registry modules. The parameter names are verl
0.9.1's: change an entry only together with the code that relies on it.

Constructors and factories (:data:`CALLED`): every verl class we build, by a call of ours (``LLMServerManager.create(
config=..., start_rank=0)`` in ``driver/placements.py``, ``TokenOutput(...)``) or through a subclass of ours whose
construction reaches verl's ``__init__`` (``StagedCheckpointEngineManager`` -> ``CheckpointEngineManager.__init__``),
pinned to its parameters; a test walks our source and our subclasses and fails on one not listed.

verl's client, ``LLMServerClient.generate``: ``InterruptibleLLMClient`` (``agent_loop/llm_client.py``) replaces it whole
and calls verl's once per request of an interrupted call (``_generate_once``). verl's open PR #6865 adds dispatch and
complete hooks inside ``generate`` and an ``llm_client_class`` key. For our client that would mean: (1) the hooks
would run once per request, not once per call: a request cut by a weight update would "complete" with the aborted
partial output, and a hook would never see the merged output (every token, the per-token versions, the summed
``num_preempted``) our ``generate`` returns; (2) anything verl then does in ``generate`` around the hooks, ours does
not do once per call; (3) ``llm_client_class`` would be a config seam for what our ``get_llm_client`` override does
(pinned in :data:`OVERRIDES`), and a recipe setting it under ``areal.enable`` would be overridden by ours, without a
word, until the validation refuses or routes it. :data:`CLIENT_GENERATE_SELF_REFERENCES` pins what verl's ``generate``
asks of ``self`` today; a new call there (a hook) fails the test naming it, so that it is handled in ours before a
verl with it is supported (docs/design.md, How it sits on verl 0.9.1: verl's client and the next release).
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import pkgutil
import re
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]

#: ``module`` (a module) or ``module:qualname`` -> the parameter names we call or override it with; None: we use
#: the name itself (a class, a registry, a constant), which must exist.
SEAMS: dict[str, tuple[str, ...] | None] = {
    # patches/vlm_position_ids.py: verl's relabelling of 3-D positions, where it is defined and where imported.
    "verl.utils.tensordict_utils:maybe_fix_3d_position_ids": ("data",),
    "verl.workers.engine_workers:maybe_fix_3d_position_ids": ("data",),
    "verl.workers.engine.base:maybe_fix_3d_position_ids": ("data",),
    "verl.utils.dataset.rl_dataset:RLHFDataset": None,
    # Registries and their seams (verl_plugin.py registers into each once verl imports it).
    "verl.plugin.platform": None,
    "verl.plugin.platform:PlatformRegistry": None,
    "verl.plugin.platform:PlatformRegistry.register": ("cls", "platform"),
    "verl.plugin.platform:PlatformRegistry.get": ("cls", "name"),
    "verl.plugin.platform.platform_base:PlatformBase": None,
    "verl.workers.rollout.base": None,
    "verl.workers.rollout.base:_ROLLOUT_REGISTRY": None,
    "verl.workers.rollout.base:BaseRollout": None,
    "verl.workers.rollout.replica": None,
    "verl.workers.rollout.replica:RolloutReplicaRegistry": None,
    "verl.workers.rollout.replica:RolloutReplicaRegistry.register": ("cls", "name", "loader"),
    "verl.workers.rollout.replica:RolloutMode": None,
    "verl.workers.rollout.replica:RolloutReplica": None,
    "verl.workers.rollout.replica:TokenOutput": None,
    "verl.trainer.ppo.core_algos": None,
    "verl.trainer.ppo.core_algos:POLICY_LOSS_REGISTRY": None,
    "verl.trainer.ppo.core_algos:register_policy_loss": ("name",),
    # The arguments verl passes a policy loss (ours take the same names: trainer_workers/policy_loss.py).
    "verl.trainer.ppo.core_algos:compute_policy_loss_vanilla": (
        "old_log_prob",
        "log_prob",
        "advantages",
        "response_mask",
        "loss_agg_mode",
        "config",
        "rollout_is_weights",
    ),
    "verl.trainer.ppo.v1": None,
    "verl.trainer.ppo.v1:get_trainer_cls": ("name",),
    "verl.trainer.ppo.v1:register_trainer": ("name",),
    "verl.trainer.ppo.v1.trainer_base:PPOTrainer": None,
    "verl.trainer.ppo.v1.trainer_base:TRAINER_REGISTRY": None,
    "verl.trainer.ppo.v1.trainer_base:register_trainer": ("name",),
    "verl.trainer.ppo.v1.trainer_sync:PPOTrainerSync": None,
    "verl.checkpoint_engine": None,
    "verl.checkpoint_engine.base:CheckpointEngine": None,
    "verl.checkpoint_engine.base:CheckpointEngineManager": None,
    # Replicas leave and join the weight sync through verl's elastic-replica seams (driver/replica_lists.py).
    "verl.checkpoint_engine.base:CheckpointEngineManager.add_replicas": ("self", "replicas"),
    "verl.checkpoint_engine.base:CheckpointEngineManager.remove_replicas": ("self", "replicas"),
    "verl.checkpoint_engine.base:CheckpointEngineRegistry": None,
    "verl.checkpoint_engine.base:CheckpointEngineRegistry._registry": None,
    "verl.checkpoint_engine.base:CheckpointEngineRegistry.register": ("backend",),
    "verl.checkpoint_engine.base:_worker_cls": ("args", "kwargs"),
    # Other names we import.
    "verl.experimental.agent_loop.tool_parser:FunctionCall": None,
    "verl.experimental.agent_loop.tool_parser:ToolParser": None,
    "verl.single_controller.ray:RayClassWithInitArgs": None,
    "verl.single_controller.ray:RayWorkerGroup": None,
    "verl.tools.function_tool:function_tool": ("name", "schema"),
    "verl.trainer.ppo.utils:need_critic": ("config",),
    "verl.trainer.ppo.utils:need_reference_policy": ("config",),
    "verl.trainer.ppo.v1.agent_loop_tq:AgentLoopManagerTQ": None,
    "verl.trainer.ppo.v1.agent_loop_tq:AgentLoopWorkerTQ": None,
    "verl.trainer.ppo.v1.replay_buffer:ReplayBuffer": None,
    "verl.utils.tensordict_utils": None,
    "verl.utils.config:omega_conf_to_dataclass": ("config", "dataclass_type"),
    "verl.utils.debug:marked_timer": ("name", "timing_raw", "color", "domain", "category"),
    "verl.utils.device:get_device_name": (),
    "verl.utils.net_utils:get_free_port": ("address", "with_alive_sock"),
    "verl.utils.ray_utils:auto_await": ("func",),
    "verl.utils.tokenizer.continuous_token:QwenContinuousTokenBuilder": None,
    "verl.workers.rollout.llm_server:LLMServerClient": None,
    "verl.workers.rollout.llm_server:LLMServerManager": None,
    "verl.workers.rollout.llm_server:LLMServerManager.get_replicas": ("self",),
    "verl.workers.rollout.utils:ensure_async_iterator": ("iterable",),
    # Patch targets (patches/*.py TARGETS / MODULE): replaced functions keep these parameters.
    "verl.single_controller.ray.base": None,
    "verl.single_controller.ray.base:get_master_addr_port": None,
    "verl.utils.config:validate_config": ("config", "use_reference_policy", "use_critic"),
    "verl.utils.distributed:initialize_global_process_group_ray": ("timeout_second", "backend"),
    "verl.workers.engine_workers:initialize_global_process_group_ray": ("timeout_second", "backend"),
    "verl.workers.engine.utils:rearrange_micro_batches": (
        "batch",
        "max_token_len",
        "dp_group",
        "num_batches_divided_by",
        "same_micro_num_in_dp",
        "min_num_micro_batch",
        "use_dynamic_bsz_balance",
        "force_group_size",
    ),
    # patches/lora_separate_sync.py replaces its checkpoint-engine path for an unmerged LoRA adapter (the verl
    # behaviour it replaces is pinned in tests/unit/test_lora_separate_sync.py).
    "verl.workers.engine_workers:ActorRolloutRefWorker.update_weights": ("self", "global_steps", "mode"),
    # patches/fsdp_router_replay.py wraps it and reads the engine's ``module`` and ``use_ulysses_sp``.
    "verl.workers.engine.fsdp.transformer_impl:FSDPEngineWithLMHead.prepare_model_inputs": ("self", "micro_batch"),
    "verl.workers.engine.fsdp.transformer_impl:prepare_micro_batches": (
        "data",
        "dp_group",
        "num_batches_divided_by",
        "same_micro_num_in_dp",
        "min_num_micro_batch",
        "use_dynamic_bsz_balance",
    ),
    # patches/fsdp1_cpu.py: FSDP1 (strategy: fsdp) on the CPU platform; torch's check it skips under gloo, verl's
    # staging it leaves on the CPU.
    "torch.distributed.fsdp._init_utils:_check_module_states_for_sync_module_states": ("module_states",),
    "verl.utils.fsdp_utils:load_fsdp_model_to_gpu": ("model",),
    "verl.utils.fsdp_utils:fsdp_version": ("model",),
}

#: verl's vLLM modules import only where vLLM does (.venv-verl-vllm); checked there, skipped elsewhere.
VLLM_SEAMS: dict[str, tuple[str, ...] | None] = {
    "verl.utils.vllm:resolve_weight_name": ("model", "name", "model_weight_names"),
    "verl.workers.rollout.vllm_rollout.bucketed_weight_transfer:BucketedWeightReceiver": None,
    "verl.workers.rollout.vllm_rollout.utils:vLLMColocateWorkerExtension": None,
    "verl.workers.rollout.vllm_rollout.vllm_async_server:vLLMHttpServer": None,
    "verl.workers.rollout.vllm_rollout.vllm_async_server:vLLMReplica": None,
    "verl.workers.rollout.vllm_rollout.vllm_rollout:ServerAdapter": None,
}

#: verl methods our subclasses override -> the parameters verl calls them with. Private ones (leading ``_``)
#: have no public seam: docs/design.md ("verl's private methods we override") says why for each.
OVERRIDES: dict[str, tuple[str, ...]] = {
    # tiny/picture_dataset.py: pictures loaded with PIL on the CPU box (verl's loader imports torchvision).
    "verl.utils.dataset.rl_dataset:RLHFDataset._process_multi_modal_info": (
        "cls",
        "messages",
        "image_patch_size",
        "config",
    ),
    "verl.trainer.ppo.v1.trainer_base:PPOTrainer._build_replay_buffer": ("self",),
    "verl.trainer.ppo.v1.trainer_base:PPOTrainer._setup": ("self",),
    "verl.trainer.ppo.v1.trainer_base:PPOTrainer._rollout_server_managers": ("self",),
    "verl.trainer.ppo.v1.trainer_base:PPOTrainer._get_n_gpus_for_throughput": ("self",),
    "verl.trainer.ppo.v1.trainer_base:PPOTrainer._compute_old_log_prob": ("self", "batch", "metrics"),
    "verl.trainer.ppo.v1.trainer_base:PPOTrainer._update_actor": ("self", "batch", "metrics"),
    "verl.trainer.ppo.v1.trainer_base:PPOTrainer._validate": ("self",),
    "verl.trainer.ppo.v1.trainer_base:PPOTrainer._add_prompts_to_generate": ("self", "num_prompts"),
    "verl.trainer.ppo.v1.trainer_base:PPOTrainer._save_checkpoint": ("self",),
    "verl.trainer.ppo.v1.trainer_base:PPOTrainer._load_checkpoint": ("self",),
    "verl.trainer.ppo.v1.trainer_base:PPOTrainer._compute_metrics": (
        "self",
        "batch",
        "metrics",
        "timing_raw",
        "global_steps",
        "epoch",
    ),
    "verl.trainer.ppo.v1.trainer_base:PPOTrainer._balance_batch": (
        "self",
        "batch",
        "metrics",
        "logging_prefix",
        "keep_minibatch",
    ),
    "verl.trainer.ppo.v1.trainer_base:PPOTrainer.get_llm_client": ("self",),
    "verl.trainer.ppo.v1.trainer_base:PPOTrainer.init": ("self",),
    "verl.trainer.ppo.v1.trainer_sync:PPOTrainerSync.on_init_end": ("self",),
    "verl.trainer.ppo.v1.trainer_sync:PPOTrainerSync.on_step_end": ("self",),
    "verl.trainer.ppo.v1.trainer_base:PPOTrainer.on_init_end": ("self",),
    "verl.trainer.ppo.v1.trainer_base:PPOTrainer.on_train_begin": ("self",),
    "verl.trainer.ppo.v1.trainer_base:PPOTrainer.prepare_step": ("self",),
    "verl.trainer.ppo.v1.trainer_base:PPOTrainer.on_step_begin": ("self",),
    "verl.trainer.ppo.v1.trainer_base:PPOTrainer.on_sample_end": ("self",),
    "verl.trainer.ppo.v1.trainer_base:PPOTrainer.step": ("self", "metrics", "timing_raw"),
    "verl.trainer.ppo.v1.trainer_base:PPOTrainer.on_step_end": ("self",),
    "verl.trainer.ppo.v1.trainer_base:PPOTrainer.fit": ("self", "agent_loop_manager"),
    "verl.trainer.ppo.v1.replay_buffer:ReplayBuffer.sample": ("self", "global_steps", "partition_id", "batch_size"),
    "verl.workers.rollout.replica:RolloutReplica.rollout_worker_use_gpu": ("self",),
    "verl.workers.rollout.replica:RolloutReplica.launch_servers": ("self",),
    "verl.workers.rollout.base:BaseRollout.resume": ("self", "tags"),
    "verl.workers.rollout.base:BaseRollout.release": ("self",),
    "verl.workers.rollout.base:BaseRollout.update_weights": ("self", "weights", "wire_format", "kwargs"),
    "verl.checkpoint_engine.base:CheckpointEngine.prepare": ("self",),
    "verl.checkpoint_engine.base:CheckpointEngine.build_topology": (
        "cls",
        "actor_wg_world_size",
        "rollout_world_size",
        "metadata",
    ),
    "verl.checkpoint_engine.base:CheckpointEngine.init_process_group": ("self", "kwargs"),
    "verl.checkpoint_engine.base:CheckpointEngine.finalize": ("self",),
    "verl.checkpoint_engine.base:CheckpointEngine.send_weights": ("self", "weights", "global_steps"),
    "verl.checkpoint_engine.base:CheckpointEngine.receive_weights": ("self", "global_steps"),
    "verl.checkpoint_engine.base:CheckpointEngineManager.update_weights": ("self", "global_steps"),
    "verl.experimental.agent_loop.agent_loop:AgentLoopWorker._run_agent_loop": (
        "self",
        "sampling_params",
        "trajectory",
        "agent_name",
        "trace",
        "_ray_trace_ctx",
        "kwargs",
    ),
    "verl.trainer.ppo.v1.agent_loop_tq:AgentLoopWorkerTQ._run_prompt": (
        "prompt",
        "sampling_params",
        "trajectory",
        "trace",
        "_ray_trace_ctx",
    ),
    "verl.trainer.ppo.v1.agent_loop_tq:AgentLoopWorkerTQ._agent_loop_postprocess": (
        "output",
        "validate",
        "_ray_trace_ctx",
        "kwargs",
    ),
    "verl.workers.rollout.llm_server:LLMServerClient._acquire_server": ("self", "request_id", "extra"),
    "verl.workers.rollout.llm_server:LLMServerClient.generate": (
        "self",
        "request_id",
        "prompt_ids",
        "sampling_params",
        "image_data",
        "video_data",
        "audio_data",
        "mm_processor_kwargs",
        "kwargs",
    ),
}

#: verl constructors and factories we call -> their parameters. ``module:Class``: building the class (its
#: ``__init__``'s parameters, ``self`` left out; a pydantic model's fields); ``module:Class.method``: a factory.
CALLED: dict[str, tuple[str, ...]] = {
    # tiny/picture_dataset.py subclasses it; verl builds it (data.custom_cls) with these.
    "verl.utils.dataset.rl_dataset:RLHFDataset": (
        "data_files",
        "tokenizer",
        "config",
        "processor",
        "max_samples",
    ),
    # driver/placements.py Separate.setup: LLMServerManager.create(config=config, start_rank=0). create forwards
    # *args, **kwargs to the class, so the keywords we pass are the class's parameters.
    "verl.workers.rollout.llm_server:LLMServerManager.create": ("cls", "args", "kwargs"),
    "verl.workers.rollout.llm_server:LLMServerManager": (
        "config",
        "worker_group",
        "rollout_resource_pool",
        "start_rank",
        "load_balancer_cls",
    ),
    # driver/async_trainer.py get_llm_client: get_client(client_cls=...), which builds our client with
    # config= and load_balancer_handle=.
    "verl.workers.rollout.llm_server:LLMServerManager.get_client": ("self", "client_cls", "kwargs"),
    "verl.workers.rollout.llm_server:LLMServerClient": ("config", "load_balancer_handle", "kwargs"),
    # driver/placements.py: StagedCheckpointEngineManager(config=, actor_wg=, replicas=), verl's __init__.
    "verl.checkpoint_engine.base:CheckpointEngineManager": ("config", "actor_wg", "replicas"),
    # driver/async_trainer.py _build_replay_buffer: _ArealReplayBuffer(take_train_batch, **these by keyword).
    "verl.trainer.ppo.v1.replay_buffer:ReplayBuffer": (
        "trainer_mode",
        "trainer_config",
        "max_off_policy_threshold",
        "max_off_policy_strategy",
        "sampler_kwargs",
        "poll_interval",
        "refill_fn",
        "filter_groups_metric",
        "train_batch_size",
        "gen_batch_size",
        "max_inflight_gen_batches",
        "sync_refill_failed_groups",
    ),
    # ArealAsyncTrainer / areal_sync: super().__init__(config).
    "verl.trainer.ppo.v1.trainer_base:PPOTrainer": ("config",),
    # rollout/verl_registration.py ArealServerAdapter: super().__init__(config, model_config, device_mesh).
    "verl.workers.rollout.base:BaseRollout": ("config", "model_config", "device_mesh", "args", "kwargs"),
    # rollout/verl_registration.py ArealRolloutReplica: verl builds it with these (registry loader).
    "verl.workers.rollout.replica:RolloutReplica": (
        "replica_rank",
        "config",
        "model_config",
        "gpus_per_node",
        "is_reward_model",
        "is_teacher_model",
        "name_suffix",
    ),
    # agent_loop/episode_workers.py: EpisodeAgentLoopWorker.__init__(config, ...) and ArealAgentLoopManager pass
    # through verl's TQ classes (*args, **kwargs) to these, config first.
    "verl.trainer.ppo.v1.agent_loop_tq:AgentLoopWorkerTQ": ("args", "_ray_trace_ctx", "kwargs"),
    "verl.experimental.agent_loop.agent_loop:AgentLoopWorker": (
        "config",
        "llm_client",
        "teacher_client",
        "reward_loop_worker_handles",
    ),
    "verl.trainer.ppo.v1.agent_loop_tq:AgentLoopManagerTQ": ("args", "kwargs"),
    "verl.experimental.agent_loop.agent_loop:AgentLoopManager": (
        "config",
        "llm_client",
        "teacher_client",
        "reward_loop_worker_handles",
    ),
    # TokenOutput(...) in agent_loop/llm_client.py, partial_outputs.py, replay/agent_loop_side.py, rollout/base.py.
    "verl.workers.rollout.replica:TokenOutput": (
        "token_ids",
        "log_probs",
        "routed_experts",
        "stop_reason",
        "num_preempted",
        "extra_fields",
    ),
    # tiny/calculator.py: FunctionCall(name=, arguments=), QwenContinuousTokenBuilder(tokenizer), ToolParser.register.
    "verl.experimental.agent_loop.tool_parser:FunctionCall": ("arguments", "name", "tool_call_id"),
    "verl.experimental.agent_loop.tool_parser:ToolParser.register": ("cls", "name"),
    "verl.utils.tokenizer.continuous_token:QwenContinuousTokenBuilder": ("tokenizer", "kwargs"),
    # weight_sync/staged.py: RayWorkerGroup(worker_handles=, ray_cls_with_init=RayClassWithInitArgs(cls=...)).
    "verl.single_controller.ray:RayWorkerGroup": (
        "resource_pool",
        "ray_cls_with_init",
        "bin_pack",
        "name_prefix",
        "detached",
        "worker_names",
        "worker_handles",
        "ray_wait_register_center_timeout",
        "kwargs",
    ),
    "verl.single_controller.ray:RayClassWithInitArgs": ("cls", "args", "kwargs"),
}

#: The same for verl's vLLM modules (checked where vLLM imports).
VLLM_CALLED: dict[str, tuple[str, ...]] = {
    # rollout/verl_vllm/worker_extension.py: BucketedWeightReceiver(zmq_handle=, device=, use_shm=).
    "verl.workers.rollout.vllm_rollout.bucketed_weight_transfer:BucketedWeightReceiver": (
        "zmq_handle",
        "device",
        "use_shm",
    ),
}

#: What verl's ``LLMServerClient.generate`` asks of ``self`` (calls and attributes), which ours replaces whole.
#: A name added there (PR #6865's dispatch/complete hooks) is a step our ``generate`` skips: handle it in
#: ``agent_loop/llm_client.py`` first, then add it here.
CLIENT_GENERATE = "verl.workers.rollout.llm_server:LLMServerClient.generate"
CLIENT_GENERATE_SELF_REFERENCES: dict[str, frozenset[str]] = {
    # Routing: which server; ours wraps _acquire_server (OVERRIDES) and calls verl's generate per request.
    "calls": frozenset({"_acquire_server", "_vllm_request_id", "_release_server"}),
    "attributes": frozenset({"config"}),
}

#: The platform's whole interface is overridden (a new device): its methods are PlatformBase's abstract ones.
PLATFORM_BASE = "verl.plugin.platform.platform_base:PlatformBase"


def _resolve(key: str) -> Any:
    module_name, _, qualname = key.partition(":")
    target: Any = importlib.import_module(module_name)
    for part in filter(None, qualname.split(".")):
        target = inspect.getattr_static(target, part) if inspect.isclass(target) else getattr(target, part)
    return target


def _parameters(target: Any) -> tuple[str, ...]:
    if isinstance(target, (staticmethod, classmethod)):
        target = target.__func__
    if isinstance(target, property):
        target = target.fget
    return tuple(inspect.signature(target).parameters)


def _moved(seams: dict[str, tuple[str, ...] | None]) -> list[str]:
    problems = []
    for key, expected in seams.items():
        try:
            target = _resolve(key)
        except (ImportError, AttributeError) as error:
            problems.append(f"{key}: gone ({type(error).__name__}: {error})")
            continue
        if expected is not None and _parameters(target) != expected:
            problems.append(f"{key}: parameters {_parameters(target)}, we rely on {expected}")
    return problems


def test_every_pinned_verl_name_is_where_we_rely_on_it() -> None:
    problems = _moved(SEAMS) + _moved(dict(OVERRIDES))
    assert not problems, "verl moved names areal_plugins relies on:\n" + "\n".join(problems)


def test_verl_vllm_names_are_where_we_rely_on_them() -> None:
    try:
        importlib.import_module("verl.workers.rollout.vllm_rollout.vllm_async_server")
    except Exception as error:  # verl refuses to import it without vLLM (ValueError), a missing dep ImportError
        pytest.skip(f"verl's vLLM modules do not import here ({type(error).__name__}); run in .venv-verl-vllm")
    problems = _moved(VLLM_SEAMS)
    assert not problems, "verl moved vLLM names areal_plugins relies on:\n" + "\n".join(problems)


def _our_verl_names() -> set[str]:
    """``module`` / ``module:name`` for every verl import and patch target in areal_plugins and patches/."""
    names: set[str] = set()
    for root in ("areal_plugins", "patches"):
        for path in sorted((ROOT / root).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "verl":
                    names.update(f"{node.module}:{alias.name}" for alias in node.names)
                elif isinstance(node, ast.Import):
                    names.update(alias.name for alias in node.names if alias.name.split(".")[0] == "verl")
                elif (
                    isinstance(node, ast.Assign)
                    and len(node.targets) == 1
                    and isinstance(node.targets[0], ast.Name)
                    and node.targets[0].id in ("TARGETS", "MODULE")
                ):
                    value = ast.literal_eval(node.value)
                    if isinstance(value, str):
                        names.add(value)
                    else:
                        names.update(f"{module}:{name}" for module, name in value)
    # "from verl.x import y" where y is a module: pinned as the module.
    return {_as_module(name) for name in names}


def _as_module(name: str) -> str:
    module, _, attribute = name.partition(":")
    if attribute:
        try:
            importlib.import_module(f"{module}.{attribute}")
        except ImportError:
            return name
        except Exception:  # a verl module that refuses to import here (vLLM's): keep the name as written
            return name
        return f"{module}.{attribute}"
    return name


def test_every_verl_name_our_source_uses_is_pinned() -> None:
    unlisted = sorted(_our_verl_names() - set(SEAMS) - set(VLLM_SEAMS))
    assert not unlisted, f"add these verl names we use to SEAMS in {Path(__file__).name}: {unlisted}"


def test_every_registry_module_the_plugin_watches_is_pinned() -> None:
    from areal_plugins.verl_plugin import REGISTRATIONS

    assert not sorted(set(REGISTRATIONS) - set(SEAMS))


def _our_verl_subclasses() -> list[type]:
    """Our classes with a verl base: module-level ones of every module that imports here, and the built ones."""
    import areal_plugins
    from areal_plugins.driver import register_trainers
    from areal_plugins.platforms.cpu import build_platform_class
    from areal_plugins.rollout import verl_registration
    from areal_plugins.weight_sync import gloo

    register_trainers()
    from verl.checkpoint_engine.base import CheckpointEngineRegistry
    from verl.trainer.ppo.v1 import get_trainer_cls

    gloo.register_gloo_checkpoint_engine()
    classes: list[type] = [
        get_trainer_cls("areal_sync"),
        verl_registration.ArealRolloutReplica,
        verl_registration.ArealServerAdapter,
        CheckpointEngineRegistry._registry[gloo.BACKEND_NAME],
        build_platform_class(),
    ]
    for info in pkgutil.walk_packages(areal_plugins.__path__, "areal_plugins."):
        if ".verl_vllm" in info.name:  # needs vLLM (VLLM_SEAMS)
            continue
        try:
            module = importlib.import_module(info.name)
        except ValueError as error:  # verl's tool registry loaded this file by its path already (another test)
            if "already registered" not in str(error):
                raise
            origin = importlib.util.find_spec(info.name).origin  # type: ignore[union-attr]
            module = next(m for m in list(sys.modules.values()) if getattr(m, "__file__", None) == origin)
        for value in vars(module).values():
            if inspect.isclass(value) and value.__module__ == module.__name__ and _verl_bases(value):
                classes.append(value)
    return classes


def _verl_bases(cls: type) -> list[type]:
    return [base for base in cls.__mro__[1:] if base.__module__.split(".")[0] == "verl"]


def _overrides(cls: type) -> set[str]:
    """``verl_module:Class.method`` for each verl attribute a class of ours in ``cls``'s MRO redefines."""
    found = set()
    mro = cls.__mro__
    for position, mine in enumerate(mro):
        if mine.__module__.split(".")[0] == "verl" or mine is object:
            continue
        for name in vars(mine):
            if name.startswith("__") or name == "_abc_impl":
                continue
            owner = next(
                (base for base in mro[position + 1 :] if base in _verl_bases(cls) and name in vars(base)), None
            )
            if owner is not None and f"{owner.__module__}:{owner.__qualname__}" != PLATFORM_BASE:
                found.add(f"{owner.__module__}:{owner.__qualname__}.{name}")
    return found


def test_every_verl_method_we_override_is_pinned() -> None:
    overridden: set[str] = set()
    for cls in _our_verl_subclasses():
        overridden |= _overrides(cls)
    unlisted = sorted(overridden - set(OVERRIDES))
    assert not unlisted, f"add these verl methods we override to OVERRIDES in {Path(__file__).name}: {unlisted}"


def test_docs_list_each_private_override_with_why() -> None:
    design = (ROOT / "docs" / "design.md").read_text()
    section = design.split("### verl's private methods we override", 1)
    assert len(section) == 2, "docs/design.md lacks the section '### verl's private methods we override'"
    body = re.split(r"\n#{2,3} ", section[1], maxsplit=1)[0]
    private = sorted({key.rsplit(".", 1)[1] for key in OVERRIDES if key.rsplit(".", 1)[1].startswith("_")})
    missing = [name for name in private if f"`{name}`" not in body]
    assert not missing, f"docs/design.md's private-override list lacks {missing}"


def _class_or_factory(key: str) -> Any:
    """A :data:`CALLED` key's target: the class (a Ray actor class's own class) or the factory."""
    module_name, _, qualname = key.partition(":")
    owner, _, method = qualname.partition(".")
    target: Any = getattr(importlib.import_module(module_name), owner)
    target = getattr(target, "__ray_actor_class__", target)
    return inspect.getattr_static(target, method) if method else target


def _called_parameters(key: str) -> tuple[str, ...]:
    target = _class_or_factory(key)
    return tuple(inspect.signature(target).parameters) if inspect.isclass(target) else _parameters(target)


def _called_moved(pins: dict[str, tuple[str, ...]]) -> list[str]:
    problems = []
    for key, expected in pins.items():
        try:
            found = _called_parameters(key)
        except (ImportError, AttributeError) as error:
            problems.append(f"{key}: gone ({type(error).__name__}: {error})")
            continue
        if found != expected:
            problems.append(f"{key}: parameters {found}, we call it with {expected}")
    return problems


def test_every_verl_constructor_and_factory_we_call_takes_what_we_pass() -> None:
    problems = _called_moved(CALLED)
    assert not problems, "verl re-signed constructors or factories areal_plugins calls:\n" + "\n".join(problems)


def test_verl_vllm_constructors_take_what_we_pass() -> None:
    try:
        importlib.import_module("verl.workers.rollout.vllm_rollout.bucketed_weight_transfer")
    except Exception as error:  # verl refuses to import it without vLLM (ValueError), a missing dep ImportError
        pytest.skip(f"verl's vLLM modules do not import here ({type(error).__name__}); run in .venv-verl-vllm")
    problems = _called_moved(VLLM_CALLED)
    assert not problems, "verl re-signed vLLM-side constructors areal_plugins calls:\n" + "\n".join(problems)


def _our_verl_calls() -> set[str]:
    """``module:Class`` / ``module:Class.method`` for each verl class our source calls, or calls a method of."""
    found: set[str] = set()
    for root in ("areal_plugins", "patches"):
        for path in sorted((ROOT / root).rglob("*.py")):
            tree = ast.parse(path.read_text(), str(path))
            imported = {
                alias.asname or alias.name: f"{node.module}:{alias.name}"
                for node in ast.walk(tree)
                if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "verl"
                for alias in node.names
            }
            for node in ast.walk(tree):
                if not isinstance(node, ast.Call):
                    continue
                func = node.func
                if isinstance(func, ast.Name) and func.id in imported:
                    found.add(imported[func.id])
                elif isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id in imported:
                    found.add(f"{imported[func.value.id]}.{func.attr}")
    classes = set()
    for key in found:
        module_name, _, qualname = key.partition(":")
        owner = qualname.split(".")[0]
        try:
            target = getattr(importlib.import_module(module_name), owner)
        except Exception:  # verl's vLLM modules where vLLM does not import: judged by name (classes are capitalized)
            target = None
        if inspect.isclass(target) or hasattr(target, "__ray_actor_class__") or (target is None and owner[0].isupper()):
            classes.add(key)
    return classes


def _inherited_constructors() -> set[str]:
    """``module:Class`` of each verl ``__init__`` that building one of our subclasses runs, down to the first that
    takes more than ``*args, **kwargs`` through."""
    found = set()
    for cls in _our_verl_subclasses():
        for base in cls.__mro__[1:]:
            if base.__module__.split(".")[0] != "verl" or "__init__" not in vars(base):
                continue
            found.add(f"{base.__module__}:{base.__qualname__}")
            parameters = inspect.signature(vars(base)["__init__"]).parameters.values()
            passing = {inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD}
            if any(p.kind not in passing and p.name not in ("self", "_ray_trace_ctx") for p in parameters):
                break
    return found


def test_every_verl_constructor_and_factory_we_call_is_pinned() -> None:
    pinned = set(CALLED) | set(VLLM_CALLED) | {key for key, expected in SEAMS.items() if expected is not None}
    pinned |= {key for key, expected in VLLM_SEAMS.items() if expected is not None}
    unlisted = sorted((_our_verl_calls() | _inherited_constructors()) - pinned)
    assert not unlisted, f"add these verl constructors/factories we call to CALLED in {Path(__file__).name}: {unlisted}"


def self_references(function: Any) -> dict[str, set[str]]:
    """The ``self.<name>(...)`` calls and other ``self.<name>`` reads in ``function``'s source."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(inspect.unwrap(function))))
    calls = {
        node.func.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id == "self"
    }
    reads = {
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self"
    }
    return {"calls": calls, "attributes": reads - calls}


def test_verls_client_generate_has_no_step_ours_skips() -> None:
    """PR #6865's hooks (or any new step) inside verl's ``generate``, which ``InterruptibleLLMClient`` replaces."""
    found = self_references(_resolve(CLIENT_GENERATE))
    new = {kind: sorted(found[kind] - CLIENT_GENERATE_SELF_REFERENCES[kind]) for kind in found}
    assert not any(new.values()), (
        f"verl's LLMServerClient.generate now also uses self.{new}: agent_loop/llm_client.py replaces it whole and "
        "calls it once per request, so a hook there runs per request and never sees the merged output. Handle it in "
        "InterruptibleLLMClient.generate, then add it to CLIENT_GENERATE_SELF_REFERENCES"
    )
    gone = {kind: sorted(CLIENT_GENERATE_SELF_REFERENCES[kind] - found[kind]) for kind in found}
    assert not any(gone.values()), f"verl's LLMServerClient.generate no longer uses self.{gone}: update the pin"


def test_the_generate_check_sees_a_new_hook() -> None:
    class Client:
        async def generate(self, request_id: str) -> None:
            server_id, _ = await self._acquire_server(request_id)
            self._on_dispatch(request_id)
            self._release_server(server_id)

    found = self_references(Client.generate)
    assert found["calls"] - CLIENT_GENERATE_SELF_REFERENCES["calls"] == {"_on_dispatch"}
