"""Does a composed recipe fit a declared GPU cluster? Pools, tensor parallelism, engine memory, on a laptop.

``areal-plugins check RECIPE --nodes M --gpus-per-node N`` runs this after every startup check
(:mod:`areal_plugins.run.preflight`): the arithmetic a launch would otherwise discover minutes in, on the
cluster, as a placement group that never schedules or an engine that runs out of memory.
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from areal_plugins.planning.hardware import MODELS, ModelShape
from areal_plugins.run.preflight import RecipeRefusedError

GIB = 1024**3
#: Bytes per parameter of the engine's weights, by verl's ``rollout.dtype``.
DTYPE_BYTES = {"bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2, "float32": 4, "fp32": 4}
#: verl's nccl checkpoint engine keeps two buckets (send and receive) on every engine GPU.
BUCKETS_PER_GPU = 2


@dataclass(frozen=True)
class Cluster:
    """The cluster a recipe is checked against."""

    nodes: int
    gpus_per_node: int
    gpu_memory_gib: float = 80.0

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.gpus_per_node < 1:
            raise RecipeRefusedError(
                f"--nodes and --gpus-per-node must be >= 1, got {self.nodes} x {self.gpus_per_node}"
            )


def model_shape(path: str) -> ModelShape | None:
    """The model's shape: from its ``config.json`` where ``path`` is a local folder, else the paper's model whose
    name ``path`` contains (a hub name cannot be read offline), else None."""
    config_file = Path(path).expanduser() / "config.json"
    if config_file.is_file():
        config = json.loads(config_file.read_text())
        heads = int(config["num_attention_heads"])
        return ModelShape(
            name=Path(path).name,
            hidden=int(config["hidden_size"]),
            layers=int(config["num_hidden_layers"]),
            heads=heads,
            kv_heads=int(config.get("num_key_value_heads", heads)),
            intermediate=int(config["intermediate_size"]),
            vocab=int(config["vocab_size"]),
        )
    return next((shape for shape in MODELS.values() if shape.name.lower() in path.lower()), None)


def _place(pools: list[tuple[str, int, int]], cluster: Cluster) -> None:
    """Place each pool's ``nnodes`` groups of ``per_node`` GPUs on the cluster's nodes (largest first, first
    fit), as Ray's placement groups would need them; refuse naming the pool that does not fit."""
    free = [cluster.gpus_per_node] * cluster.nodes
    for name, nnodes, per_node in sorted(pools, key=lambda pool: -pool[2]):
        for _ in range(nnodes):
            node = next((i for i, gpus in enumerate(free) if gpus >= per_node), None)
            if node is None:
                raise RecipeRefusedError(
                    f"{name} ({nnodes} nodes x {per_node} GPUs) does not fit the cluster ({cluster.nodes} nodes x "
                    f"{cluster.gpus_per_node} GPUs) beside the other pool: lower its nnodes or n_gpus_per_node, or "
                    "declare the cluster you have (--nodes, --gpus-per-node)"
                )
            free[node] -= per_node


def fit_cluster(config: Any, cluster: Cluster) -> list[str]:
    """Check ``config`` against ``cluster``; return what would run where, one line each.

    Raises:
        RecipeRefusedError: a pool that does not fit, a tensor-parallel size that does not divide the engines'
            GPUs, or engines whose weights and transfer buckets exceed their memory budget.
    """
    trainer = config.trainer
    rollout = config.actor_rollout_ref.rollout
    areal = config.get("areal") or {}
    separate = bool(areal.get("enable")) and areal.get("mode") == "async" and areal.get("placement") == "separate"
    trainer_pool = (
        "the trainer's pool (trainer.nnodes x trainer.n_gpus_per_node)",
        trainer.nnodes,
        trainer.n_gpus_per_node,
    )
    pools = [trainer_pool]
    if separate:
        pools.append(
            (
                "the engines' pool (actor_rollout_ref.rollout.nnodes x n_gpus_per_node)",
                rollout.nnodes,
                rollout.n_gpus_per_node,
            )
        )
    for name, _, per_node in pools:
        if per_node > cluster.gpus_per_node:
            raise RecipeRefusedError(
                f"{name} asks for {per_node} GPUs per node; the cluster's nodes have {cluster.gpus_per_node}"
            )
    _place(pools, cluster)
    engine_gpus = rollout.nnodes * rollout.n_gpus_per_node if separate else trainer.nnodes * trainer.n_gpus_per_node
    engine_per_node = rollout.n_gpus_per_node if separate else trainer.n_gpus_per_node
    tp = int(rollout.tensor_model_parallel_size)
    if tp < 1 or engine_gpus % tp or tp > engine_per_node:
        raise RecipeRefusedError(
            f"actor_rollout_ref.rollout.tensor_model_parallel_size={tp} must divide the engines' {engine_gpus} GPUs "
            f"and fit one node's {engine_per_node}: set it to a divisor of {engine_per_node}"
        )
    lines = [
        f"trainer: {trainer.nnodes} node(s) x {trainer.n_gpus_per_node} GPU(s), "
        f"{config.actor_rollout_ref.actor.strategy}",
        f"engines ({rollout.name}): {engine_gpus // tp} replica(s) x TP {tp}, "
        + ("on a pool of their own" if separate else "on the trainer's GPUs (colocated: asleep while it trains)"),
    ]
    transport = rollout.checkpoint_engine.backend
    lines.append(f"weights: by the {transport!r} checkpoint engine")
    lines += _engine_memory(config, cluster, tp, transport)
    return lines


def _engine_memory(config: Any, cluster: Cluster, tp: int, transport: str) -> list[str]:
    rollout = config.actor_rollout_ref.rollout
    path = str(config.actor_rollout_ref.model.path)
    shape = model_shape(path)
    if shape is None:
        return [f"engine memory: not checked ({path} is neither a local folder with config.json nor a known model)"]
    dtype = str(rollout.get("dtype") or "bfloat16")
    weights = shape.weight_bytes / 2 * DTYPE_BYTES.get(dtype, 2) / tp  # weight_bytes counts 2 bytes a parameter
    buckets = (
        0.0
        if transport == "naive"
        else BUCKETS_PER_GPU * rollout.checkpoint_engine.update_weights_bucket_megabytes * 1024**2
    )
    budget = float(rollout.gpu_memory_utilization) * cluster.gpu_memory_gib * GIB
    if weights + buckets > budget:
        raise RecipeRefusedError(
            f"an engine GPU needs {weights / GIB:.1f} GiB of weights ({dtype}, TP {tp}) + {buckets / GIB:.1f} GiB of "
            f"transfer buckets, over its budget of {budget / GIB:.1f} GiB (gpu_memory_utilization "
            f"{rollout.gpu_memory_utilization} x {cluster.gpu_memory_gib:g} GiB): raise "
            "actor_rollout_ref.rollout.tensor_model_parallel_size or gpu_memory_utilization, or lower "
            "checkpoint_engine.update_weights_bucket_megabytes"
        )
    longest = int(config.data.max_prompt_length) + int(config.data.max_response_length)
    one_sequence = shape.kv_bytes_per_token * longest / tp
    if budget - weights - buckets < one_sequence:
        raise RecipeRefusedError(
            f"an engine GPU has {(budget - weights - buckets) / GIB:.1f} GiB left for the KV cache, less than one "
            f"sequence of {longest} tokens needs ({one_sequence / GIB:.1f} GiB): raise "
            "actor_rollout_ref.rollout.tensor_model_parallel_size or gpu_memory_utilization"
        )
    return [
        f"engine memory per GPU: weights {weights / GIB:.1f} GiB + buckets {buckets / GIB:.1f} GiB of "
        f"{budget / GIB:.1f} GiB budget -> {(budget - weights - buckets) / GIB:.1f} GiB for the KV cache"
    ]


def missing_here(config: Any) -> list[str]:
    """What this machine lacks to run ``config`` itself (informational: a laptop checks a cluster's recipe)."""
    if str(config.trainer.device) == "cpu":
        return []
    wanted = {
        "vllm": config.actor_rollout_ref.rollout.name == "vllm",
        "cupy": config.actor_rollout_ref.rollout.checkpoint_engine.backend == "nccl",
        "flash_attn": bool(config.actor_rollout_ref.model.get("use_remove_padding", False)),
    }
    return [name for name, needed in wanted.items() if needed and importlib.util.find_spec(name) is None]
