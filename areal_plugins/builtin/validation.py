"""Built-in checks of setting combinations that span the ``areal:`` node and verl's own settings."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from areal_plugins.config.settings import ArealConfig, ArealConfigError, areal_settings
from areal_plugins.hooks.hookimpl import hookimpl
from areal_plugins.platforms.cpu import cpu_platform_selected


@hookimpl(trylast=True)
def areal_validate_config(config: Any) -> None:
    areal = areal_settings(config)
    if not areal.enable:
        return
    actor = config.actor_rollout_ref.actor
    if areal.loss.decoupled and areal.loss.prox_logp == "loglinear":
        # The log-linear π_prox is exact only while θ is still the proximal policy
        # (docs/design.md, The decoupled objective).
        if actor.ppo_epochs != 1 or actor.ppo_mini_batch_size != config.data.train_batch_size:
            raise ArealConfigError(
                "areal.loss.prox_logp=loglinear needs one optimizer step per batch: set "
                "actor_rollout_ref.actor.ppo_mini_batch_size = data.train_batch_size "
                f"({config.data.train_batch_size}, got {actor.ppo_mini_batch_size}) and "
                f"actor_rollout_ref.actor.ppo_epochs=1 (got {actor.ppo_epochs}), or use areal.loss.prox_logp=recompute"
            )
    _check_mini_batches(config)
    if actor.loss_agg_mode != "token-mean" and areal.loss.decoupled:
        raise ArealConfigError(
            "the decoupled objective is a global token mean: set actor_rollout_ref.actor.loss_agg_mode=token-mean "
            f"(got {actor.loss_agg_mode!r}) or areal.loss.decoupled=false"
        )
    limit = areal.max_concurrent_rollouts
    if areal.mode == "async" and limit is not None and limit < config.data.train_batch_size:
        raise ArealConfigError(
            f"areal.max_concurrent_rollouts={limit} can never fill a batch of data.train_batch_size="
            f"{config.data.train_batch_size} prompt groups: raise it to at least {config.data.train_batch_size} or null"
        )
    if areal.mode == "async" and not config.actor_rollout_ref.rollout.calculate_log_probs:
        raise ArealConfigError(
            "async training needs the engine's per-token behaviour log-probs: remove the override "
            "actor_rollout_ref.rollout.calculate_log_probs=false"
        )
    rollout = config.actor_rollout_ref.rollout
    if areal.mode == "async":
        from areal_plugins.rollout.capabilities import check_backend_capabilities

        check_backend_capabilities(str(rollout.name), list(areal.waive_capabilities))
    if rollout.name == "vllm":  # both modes build our checked vLLM server (rollout/verl_vllm/)
        check_verl_vllm_settings(config)
        if areal.mode == "async":
            _warn_unless_validation_goes_first(rollout)
    if areal.mode == "async" and areal.placement == "separate":
        if rollout.checkpoint_engine.backend == "naive":
            raise ArealConfigError(
                "areal.placement=separate gives the engines a resource pool of their own, and weights reach it "
                "through a checkpoint engine: set actor_rollout_ref.rollout.checkpoint_engine.backend=nccl on GPUs "
                "(or areal_gloo without them); 'naive' only works for engines on the trainer's devices"
            )
        if not (rollout.nnodes > 0 and rollout.n_gpus_per_node > 0):
            raise ArealConfigError(
                "areal.placement=separate needs the size of the rollout pool: set actor_rollout_ref.rollout.nnodes "
                f"and actor_rollout_ref.rollout.n_gpus_per_node (got {rollout.nnodes} x {rollout.n_gpus_per_node})"
            )
    budget = areal.micro_batch.max_tokens
    longest = config.data.max_prompt_length + config.data.max_response_length
    if budget is not None and not (actor.use_dynamic_bsz and actor.ppo_max_token_len_per_gpu == budget):
        raise ArealConfigError(
            f"areal.micro_batch.max_tokens={budget} sets actor_rollout_ref.actor.use_dynamic_bsz=true and "
            f"ppo_max_token_len_per_gpu={budget}, but the recipe overrides them (use_dynamic_bsz="
            f"{actor.use_dynamic_bsz}, ppo_max_token_len_per_gpu={actor.ppo_max_token_len_per_gpu}): remove those "
            "two keys from the recipe"
        )
    if budget is not None and budget < longest:
        raise ArealConfigError(
            f"areal.micro_batch.max_tokens={budget} cannot hold one sequence of up to {longest} tokens "
            f"(data.max_prompt_length + data.max_response_length): raise it to at least {longest}"
        )
    if areal.mode == "async":
        _check_agent_loop_manager(rollout.get("agent", {}).get("agent_loop_manager_class"))
    check_support_matrix(config)


def vllm_scheduling_policy(rollout: Any) -> str:
    """The policy vLLM is built with: ``engine_kwargs.vllm.scheduling_policy`` if set (verl passes the engine
    kwargs after its own arguments, so they win), else ``rollout.scheduling_policy`` (verl's default ``fcfs``)."""
    engine = (rollout.get("engine_kwargs") or {}).get("vllm") or {}
    return str(engine.get("scheduling_policy") or rollout.get("scheduling_policy") or "fcfs")


def _warn_unless_validation_goes_first(rollout: Any) -> None:
    """Validation requests carry vLLM's highest priority, which only the ``priority`` policy reads (docs/backends.md,
    Validation goes first); under another one they queue behind the whole training backlog."""
    policy = vllm_scheduling_policy(rollout)
    if policy != "priority":
        logging.getLogger(__name__).warning(
            "areal: vLLM's scheduling_policy is %r, so validation queues behind every training request in flight "
            "(at scale it lasts as long as draining them); remove the override (areal.enable sets "
            "actor_rollout_ref.rollout.scheduling_policy=priority) or accept slow validation",
            policy,
        )


def _check_agent_loop_manager(class_path: str | None) -> None:
    """The async trainer needs its episode-recording workers; a recipe's own manager must extend ours."""
    from areal_plugins.config.routing import EPISODE_MANAGER_CLASS

    if class_path == EPISODE_MANAGER_CLASS:
        return
    hint = (
        f"areal.mode=async needs actor_rollout_ref.rollout.agent.agent_loop_manager_class={EPISODE_MANAGER_CLASS} "
        "(areal.enable routes it) or a subclass of it: it records the version of every generated token across "
        "an episode's turns"
    )
    if not class_path:
        raise ArealConfigError(f"{hint}; the recipe sets it to null")
    import importlib

    from areal_plugins.agent_loop.episode_workers import ArealAgentLoopManager

    module, _, name = class_path.rpartition(".")
    try:
        manager = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as error:
        raise ArealConfigError(f"{hint}; {class_path!r} cannot be imported: {error}") from error
    if not (isinstance(manager, type) and issubclass(manager, ArealAgentLoopManager)):
        raise ArealConfigError(f"{hint}; the recipe sets {class_path!r}, which does not extend it")


def _check_mini_batches(config: Any) -> None:
    """Mini-batches that split the batch evenly over the trainer's ranks: verl checks this only with fixed
    micro-batches, and ``areal.micro_batch.max_tokens`` turns on its token-budget ones, where a mini-batch larger
    than a rank's share fails at the first update instead."""
    actor = config.actor_rollout_ref.actor
    batch, mini = int(config.data.train_batch_size), int(actor.ppo_mini_batch_size)
    if mini < 1 or batch % mini:
        raise ArealConfigError(
            f"actor_rollout_ref.actor.ppo_mini_batch_size={mini} must divide data.train_batch_size={batch} "
            f"(prompt groups): set it to a divisor of {batch}, e.g. {batch} for one optimizer step per batch"
        )
    sequence_parallel = int(actor.get("ulysses_sequence_parallel_size", 1) or 1)
    ranks = int(config.trainer.nnodes) * int(config.trainer.n_gpus_per_node) // sequence_parallel
    responses = mini * int(config.actor_rollout_ref.rollout.n)
    if ranks > 0 and responses % ranks:
        raise ArealConfigError(
            f"a mini-batch of {mini} prompts x {config.actor_rollout_ref.rollout.n} responses = {responses} sequences "
            f"does not split over the trainer's {ranks} data-parallel ranks (trainer.nnodes x trainer.n_gpus_per_node"
            " / ulysses_sequence_parallel_size): change actor_rollout_ref.actor.ppo_mini_batch_size or the trainer's "
            "GPUs"
        )


def check_verl_vllm_settings(config: Any) -> None:
    """Refuse what the weight check of verl's vllm rollout (rollout/verl_vllm/) does not cover yet."""
    rollout = config.actor_rollout_ref.rollout
    uncovered = {
        "LoRA adapters sharded in rank over tensor parallelism (lora.fully_sharded_loras: each rank's slot holds "
        "part of lora_A's rank, which the adapter check does not read back)": (
            lora_rank(config) > 0
            and bool((config.actor_rollout_ref.model.get("lora") or {}).get("fully_sharded_loras")),
            "actor_rollout_ref.model.lora.fully_sharded_loras=false",
        ),
        "prefill/decode disaggregation (a replica split in two)": (
            bool((rollout.get("disaggregation") or {}).get("enabled", False)),
            "actor_rollout_ref.rollout.disaggregation.enabled=false",
        ),
        "data parallelism inside a replica (vLLM answers the check from one data-parallel shard only)": (
            int(rollout.get("data_parallel_size", 1) or 1) > 1,
            "actor_rollout_ref.rollout.data_parallel_size=1 (more replicas instead)",
        ),
        "delta weight updates (checkpoint_engine.backend=delta_sharded)": (
            str((rollout.get("checkpoint_engine") or {}).get("backend", "")) == "delta_sharded",
            "actor_rollout_ref.rollout.checkpoint_engine.backend=nccl",
        ),
    }
    for what, (used, fix) in uncovered.items():
        if used:
            raise ArealConfigError(
                f"areal_plugins checks every weight update of verl's vllm rollout tensor by tensor, and {what} does "
                f"not go through that check yet: set {fix}, or areal.enable=false for verl's own trainer"
            )


#: ``actor_rollout_ref.actor.strategy`` values areal_plugins runs on: its loss (a verl policy-loss registry entry),
#: its token-budget micro-batching and the trainer-progress patch are patched into verl's FSDP engine module
#: (``verl/workers/engine/fsdp/transformer_impl.py``), whose one class verl registers for both ``fsdp`` (FSDP1,
#: verl's default) and ``fsdp2`` (``EngineRegistry``, ``backend=["fsdp", "fsdp2"]``). CI trains with both
#: (docs/support.md, Trainer engines). megatron, veomni, torchtitan, automodel and fsdp_turbo are other engines,
#: with no CPU build here to run them on.
TESTED_ACTOR_STRATEGIES = ("fsdp", "fsdp2")
#: Half-precision spellings verl accepts for the trainer's dtypes (fp32 and bf16 are what CI runs).
HALF_DTYPES = ("fp16", "float16", "half")
#: ``config.json`` keys giving a model's experts per layer (what verl's delta_weight_transfer.py reads).
EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


def checked_checkpoint_engines() -> tuple[str, ...]:
    """Checkpoint engines whose transfer is checked tensor by tensor under ``areal_async``: ``naive`` (colocated: the
    server adapter checksums what it hands the engine), those our mixin extends (``nccl``,
    weight_sync/checked_transfer.py) and ``areal_gloo`` (its in-band check, weight_sync/gloo.py)."""
    from areal_plugins.weight_sync.checked_transfer import CHECKED_BACKENDS
    from areal_plugins.weight_sync.gloo import BACKEND_NAME

    return ("naive", *CHECKED_BACKENDS, BACKEND_NAME)


def model_config_json(config: Any) -> dict[str, Any] | None:
    """``actor_rollout_ref.model.path``'s ``config.json`` where it is a directory already on disk; None before the
    model exists (the tiny model is built after the startup checks) or for a hub id."""
    path = Path(str(config.actor_rollout_ref.model.path)) / "config.json"
    if not path.is_file():
        return None
    loaded = json.loads(path.read_text())
    return loaded if isinstance(loaded, dict) else None


def lora_rank(config: Any) -> int:
    """The LoRA rank the recipe trains with (verl reads ``model.lora_rank`` and ``model.lora.rank``); 0 without."""
    model = config.actor_rollout_ref.model
    return max(int(model.get("lora_rank", 0) or 0), int((model.get("lora") or {}).get("rank", 0) or 0))


#: Models whose routers the trainer replays (trainer_workers/router_replay.py, ``SOFTMAX_TOPK_ROUTERS``).
ROUTER_REPLAY_MODEL_TYPES = ("qwen2_moe", "qwen3_moe")


def check_router_replay(actor: Any, hf_config: dict[str, Any]) -> None:
    """Refuse router replay (R3, patches/fsdp_router_replay.py) where the trainer cannot replay the routes."""
    what = "router replay (actor_rollout_ref.rollout.enable_rollout_routing_replay=true)"
    off = "or set actor_rollout_ref.rollout.enable_rollout_routing_replay=false"
    sequence_parallel = int(actor.get("ulysses_sequence_parallel_size", 1) or 1)
    if sequence_parallel > 1:
        raise ArealConfigError(
            f"{what} with actor_rollout_ref.actor.ulysses_sequence_parallel_size={sequence_parallel}: the trainer "
            f"replays routes on whole sequences only: set actor_rollout_ref.actor.ulysses_sequence_parallel_size=1, "
            f"{off}"
        )
    model_type = hf_config.get("model_type")
    if hf_config and model_type not in ROUTER_REPLAY_MODEL_TYPES:
        raise ArealConfigError(
            f"{what} on a model of type {model_type!r} (actor_rollout_ref.model.path): the trainer replays the "
            f"routers of {', '.join(ROUTER_REPLAY_MODEL_TYPES)} models: {off.removeprefix('or ')}"
        )


def check_support_matrix(config: Any, hf_config: dict[str, Any] | None = None) -> None:
    """Refuse the setups of docs/support.md that no test of ours covers, each in one line naming the key to change.

    ``hf_config``: the model's ``config.json`` where the caller has it (``areal-plugins check --model-config`` for a
    hub id); None: ``actor_rollout_ref.model.path``'s own, where it is a local folder."""
    from areal_plugins.rollout.capabilities import require_feature

    areal = areal_settings(config)
    if not areal.enable:
        return
    actor = config.actor_rollout_ref.actor
    rollout = config.actor_rollout_ref.rollout
    backend = str(rollout.name)
    own = "or areal.enable=false for verl's own trainer"
    strategy = str(actor.strategy)
    if strategy not in TESTED_ACTOR_STRATEGIES:
        raise ArealConfigError(
            f"actor_rollout_ref.actor.strategy={strategy} is not a trainer engine areal_plugins runs its loss, "
            f"micro-batching and progress reports on (tested: {', '.join(TESTED_ACTOR_STRATEGIES)}; it has no CPU "
            f"build to test on here): set actor_rollout_ref.actor.strategy=fsdp2 (or fsdp, verl's default), {own}"
        )
    fsdp = actor.get("fsdp_config") or {}
    for key, value in (
        ("model_dtype", fsdp.get("model_dtype")),
        ("mixed_precision.param_dtype", (fsdp.get("mixed_precision") or {}).get("param_dtype")),
    ):
        if str(value) in HALF_DTYPES:
            raise ArealConfigError(
                f"actor_rollout_ref.actor.fsdp_config.{key}={value}: float16 training (loss scaling) is not tested "
                f"with areal_plugins' loss: set actor_rollout_ref.actor.fsdp_config.{key}=bf16 or fp32, {own}"
            )
    rank = lora_rank(config)
    # Merged (lora.merge: true), every update carries full weights, checked as a dense model's are.
    if rank > 0 and not bool((config.actor_rollout_ref.model.get("lora") or {}).get("merge", False)):
        require_feature(
            backend,
            "lora_adapter_check",
            f"LoRA (actor_rollout_ref.model.lora_rank={rank})",
            f"set actor_rollout_ref.model.lora_rank=0 (docs/design.md, LoRA), {own}",
        )
    if hf_config is None:
        hf_config = model_config_json(config) or {}
    experts = next((key for key in EXPERT_COUNT_KEYS if int(hf_config.get(key) or 0) > 0), None)
    if experts is not None:
        require_feature(
            backend,
            "moe_weight_check",
            f"a mixture-of-experts model ({experts}={hf_config[experts]} in actor_rollout_ref.model.path)",
            f"set actor_rollout_ref.rollout.name=areal_cpu, {own}",
        )
        if rank > 0:  # verl's vLLM loads none of the experts' base weights under an adapter (their names differ)
            raise ArealConfigError(
                f"LoRA (actor_rollout_ref.model.lora_rank={rank}) on a mixture-of-experts model ({experts}="
                f"{hf_config[experts]} in actor_rollout_ref.model.path) has not run under areal_async: set "
                f"actor_rollout_ref.model.lora_rank=0, {own}"
            )
    _check_media(hf_config, backend, own, str((config.get("trainer") or {}).get("device", "cuda")))
    if areal.mode == "async":
        device = str((config.get("trainer") or {}).get("device", "cuda"))
        _check_async_support(areal, actor, rollout, backend, hf_config, device)


def _check_media(hf_config: dict[str, Any], backend: str, own: str, device: str) -> None:
    """Refuse a model with inputs the engine does not serve: audio anywhere; images where the engine lacks the
    ``images`` capability, or from a vision-language family it does not serve (``areal_cpu``: Qwen2-VL, Qwen2.5-VL)."""
    from areal_plugins.rollout.capabilities import require_feature
    from areal_plugins.rollout.cpu.vision import SERVED_VISION_MODEL_TYPES

    if hf_config.get("audio_config"):
        require_feature(
            backend, "audio", "a model with audio inputs (audio_config in actor_rollout_ref.model.path)", own
        )
    if not hf_config.get("vision_config"):
        return
    what = "a vision-language model (vision_config in actor_rollout_ref.model.path)"
    model_type = str(hf_config.get("model_type"))
    if device != "cpu":  # areal_cpu is the CPU box's engine; vLLM's VLM path has not run under areal_async
        require_feature(
            backend,
            "images",
            what,
            "set areal.enable=false for verl's own trainer (areal_plugins has run vision-language models only on "
            "the CPU box's engine, areal_cpu)",
        )
    require_feature(backend, "images", what, f"set actor_rollout_ref.rollout.name=areal_cpu, {own}")
    if model_type not in SERVED_VISION_MODEL_TYPES:
        raise ArealConfigError(
            f"{what} of type {model_type!r}: areal_plugins serves the vision-language models "
            f"{', '.join(SERVED_VISION_MODEL_TYPES)} (their image positions, M-RoPE, are computed by the engine): "
            f"train one of those, {own}"
        )


def _check_async_support(
    areal: ArealConfig, actor: Any, rollout: Any, backend: str, hf_config: dict[str, Any], device: str
) -> None:
    """The part of :func:`check_support_matrix` for ``areal.mode: async``: router replay, and a weight transport
    whose every tensor is checked."""
    from areal_plugins.rollout.capabilities import require_feature

    if bool(rollout.get("enable_rollout_routing_replay", False)):
        require_feature(
            backend,
            "routed_experts",
            "router replay (actor_rollout_ref.rollout.enable_rollout_routing_replay=true)",
            "set actor_rollout_ref.rollout.enable_rollout_routing_replay=false",
        )
        check_router_replay(actor, hf_config)
        on_cpu = cpu_platform_selected() or device == "cpu"
        if backend == "vllm" and on_cpu and not bool(rollout.get("enforce_eager", False)):
            raise ArealConfigError(
                "router replay (actor_rollout_ref.rollout.enable_rollout_routing_replay=true) on vLLM's CPU build "
                "with actor_rollout_ref.rollout.enforce_eager=false: its compiled graph never records the routes "
                "(they come back as zeros): set actor_rollout_ref.rollout.enforce_eager=true (areal-plugins train "
                "sets it unless told otherwise)"
            )
    transport = str((rollout.get("checkpoint_engine") or {}).get("backend", "naive"))
    if areal.placement == "colocated" and transport != "naive":
        raise ArealConfigError(
            f"areal.placement=colocated with actor_rollout_ref.rollout.checkpoint_engine.backend={transport} is not "
            "a setup areal_async has run (colocated engines take the trainer's weights in its own processes): set "
            "actor_rollout_ref.rollout.checkpoint_engine.backend=naive, or areal.placement=separate"
        )
    if transport not in checked_checkpoint_engines():
        raise ArealConfigError(
            f"actor_rollout_ref.rollout.checkpoint_engine.backend={transport} delivers weights that areal_async "
            "cannot check tensor by tensor: set actor_rollout_ref.rollout.checkpoint_engine.backend=nccl (GPUs), "
            "areal_gloo (CPU) or naive (areal.placement=colocated)"
        )
