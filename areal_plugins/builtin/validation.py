"""Built-in checks of setting combinations that span the ``areal:`` node and verl's own settings."""

from __future__ import annotations

from typing import Any

from areal_plugins.config.settings import ArealConfigError
from areal_plugins.hooks.hookimpl import hookimpl


@hookimpl(trylast=True)
def areal_validate_config(config: Any) -> None:
    areal = config.areal
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
    limit = areal.get("max_concurrent_rollouts", None)
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

        check_backend_capabilities(str(rollout.name), list(areal.get("waive_capabilities") or []))
    if rollout.name == "vllm":  # both modes build our checked vLLM server (rollout/verl_vllm/)
        check_verl_vllm_settings(config)
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
    budget = (areal.get("micro_batch") or {}).get("max_tokens", None)
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
        "LoRA adapter updates": (
            int(config.actor_rollout_ref.model.get("lora_rank", 0) or 0) > 0,
            "actor_rollout_ref.model.lora_rank=0",
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
