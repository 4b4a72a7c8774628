"""Does a composed recipe fit a declared GPU cluster? Pools, engine replicas, engine memory, on a laptop.

``areal-plugins check RECIPE --nodes M --gpus-per-node N`` runs this after every startup check
(:mod:`areal_plugins.cli.preflight`): the arithmetic a launch would otherwise discover minutes in, on the
cluster, as a placement group that never schedules or an engine that runs out of memory. It follows verl
0.9.1's own order: the trainer's pool first (``trainer.nnodes`` groups of ``trainer.n_gpus_per_node``), then,
in ``separate``, one placement group per engine replica of ``min(rollout.n_gpus_per_node, TP x DP x PP)`` GPUs.
"""

from __future__ import annotations

import importlib.util
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from areal_plugins.config.errors import RecipeRefusedError
from areal_plugins.planning.hardware import MODELS, ModelShape

GIB = 1024**3
#: Bytes per parameter of the engine's weights, by verl's ``rollout.dtype``.
DTYPE_BYTES = {"bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2, "float32": 4, "fp32": 4}
#: Transfer buffers of a checkpoint engine other than ``naive``, each ``update_weights_bucket_megabytes``: the
#: engine's side holds three (verl's nccl engine sends and receives into two, vLLM's bucketed weight receiver
#: adds one), the trainer's side two; all outside ``gpu_memory_utilization``.
ENGINE_BUCKETS, TRAINER_BUCKETS = 3, 2
#: Memory an engine GPU needs beside vLLM's share and the buckets: CUDA context, NCCL, allocator slack (a
#: round estimate, not a measurement).
GPU_OVERHEAD_GIB = 2.0


@dataclass(frozen=True)
class Cluster:
    """The cluster a recipe is checked against."""

    nodes: int
    gpus_per_node: int
    gpu_memory_gib: float = 79.6

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.gpus_per_node < 1:
            raise RecipeRefusedError(
                f"--nodes and --gpus-per-node must be >= 1, got {self.nodes} x {self.gpus_per_node}"
            )


def model_shape(path: str) -> tuple[ModelShape, int | None] | None:
    """The model's shape and ``max_position_embeddings``: from its ``config.json`` where ``path`` is a local
    folder, else the paper's model whose name ``path`` contains (a hub name cannot be read offline)."""
    config_file = Path(path).expanduser() / "config.json"
    if config_file.is_file():
        config = json.loads(config_file.read_text())
        heads = int(config["num_attention_heads"])
        shape = ModelShape(
            name=Path(path).name,
            hidden=int(config["hidden_size"]),
            layers=int(config["num_hidden_layers"]),
            heads=heads,
            kv_heads=int(config.get("num_key_value_heads", heads)),
            intermediate=int(config["intermediate_size"]),
            vocab=int(config["vocab_size"]),
        )
        return shape, config.get("max_position_embeddings")
    known = next((shape for shape in MODELS.values() if shape.name.lower() in path.lower()), None)
    return (known, None) if known is not None else None


def _place(groups: list[tuple[str, int]], cluster: Cluster) -> None:
    """Place placement groups of ``size`` GPUs, in order, each on one node with room (first fit); refuse
    naming the group that finds none."""
    free = [cluster.gpus_per_node] * cluster.nodes
    for name, size in groups:
        node = next((i for i, gpus in enumerate(free) if gpus >= size), None)
        if node is None:
            raise RecipeRefusedError(
                f"{name} ({size} GPUs) finds no node with room on the cluster ({cluster.nodes} nodes x "
                f"{cluster.gpus_per_node} GPUs) after the groups before it: lower trainer.nnodes x n_gpus_per_node or "
                "actor_rollout_ref.rollout.nnodes x n_gpus_per_node, or declare the cluster you have "
                "(--nodes, --gpus-per-node)"
            )
        free[node] -= size


def fit_cluster(config: Any, cluster: Cluster) -> list[str]:
    """Check ``config`` against ``cluster``; return what would run where, one line each.

    Raises:
        RecipeRefusedError: a pool or replica that does not fit, a replica size that does not divide the
            engines' GPUs, or an engine whose weights, KV cache and transfer buckets exceed its GPU.
    """
    trainer = config.trainer
    rollout = config.actor_rollout_ref.rollout
    areal = config.get("areal") or {}
    separate = bool(areal.get("enable")) and areal.get("mode") == "async" and areal.get("placement") == "separate"
    for name, per_node in (("trainer.n_gpus_per_node", trainer.n_gpus_per_node),) + (
        (("actor_rollout_ref.rollout.n_gpus_per_node", rollout.n_gpus_per_node),) if separate else ()
    ):
        if per_node > cluster.gpus_per_node:
            raise RecipeRefusedError(f"{name}={per_node}, but the cluster's nodes have {cluster.gpus_per_node} GPUs")
    tp = int(rollout.tensor_model_parallel_size)
    world = (
        tp * int(rollout.get("data_parallel_size", 1) or 1) * int(rollout.get("pipeline_model_parallel_size", 1) or 1)
    )
    engine_gpus = rollout.nnodes * rollout.n_gpus_per_node if separate else trainer.nnodes * trainer.n_gpus_per_node
    engine_per_node = rollout.n_gpus_per_node if separate else trainer.n_gpus_per_node
    if world < 1 or engine_gpus % world or (world > engine_per_node and world % engine_per_node):
        raise RecipeRefusedError(
            f"an engine replica spans tensor x data x pipeline parallel = {world} GPUs, which must divide the engines' "
            f"{engine_gpus} GPUs (and be a multiple of {engine_per_node} per node when larger): change "
            "actor_rollout_ref.rollout.tensor_model_parallel_size"
        )
    replicas = engine_gpus // world
    groups = [("a trainer node's group", int(trainer.n_gpus_per_node))] * int(trainer.nnodes)
    if separate:
        size = min(engine_per_node, world)
        groups += [("an engine replica's group", size)] * (engine_gpus // size)
    _place(groups, cluster)
    lines = [
        f"trainer: {trainer.nnodes} node(s) x {trainer.n_gpus_per_node} GPU(s), "
        f"{config.actor_rollout_ref.actor.strategy}",
        f"engines ({rollout.name}): {replicas} replica(s) of {world} GPU(s) (TP {tp}), "
        + ("each in a placement group of its own" if separate else "on the trainer's GPUs (asleep while it trains)"),
    ]
    transport = rollout.checkpoint_engine.backend
    lines.append(f"weights: by the {transport!r} checkpoint engine")
    lines += _engine_memory(config, cluster, tp, transport, colocated=not separate)
    return lines


def _engine_memory(config: Any, cluster: Cluster, tp: int, transport: str, colocated: bool) -> list[str]:
    rollout = config.actor_rollout_ref.rollout
    path = str(config.actor_rollout_ref.model.path)
    found = model_shape(path)
    if found is None:
        return [f"engine memory: not checked ({path} is neither a local folder with config.json nor a known model)"]
    shape, max_positions = found
    dtype = str(rollout.get("dtype") or "bfloat16")
    weights = shape.weight_bytes / 2 * DTYPE_BYTES.get(dtype, 2) / tp  # weight_bytes counts 2 bytes a parameter
    vllm_share = float(rollout.gpu_memory_utilization) * cluster.gpu_memory_gib * GIB
    # vLLM refuses to start unless one sequence of max_model_len fits its KV cache (null: the model's maximum).
    length = rollout.get("max_model_len") or max_positions
    length_key = "actor_rollout_ref.rollout.max_model_len"
    if length is None:
        length = int(config.data.max_prompt_length) + int(config.data.max_response_length)
        length_key = "prompt + response: set rollout.max_model_len, or vLLM sizes for the model's maximum"
    heads_per_gpu = math.ceil(shape.kv_heads / tp)  # a KV head is not split: TP beyond the KV heads replicates them
    one_sequence = shape.kv_bytes_per_token / shape.kv_heads * heads_per_gpu * int(length)
    if weights + one_sequence > vllm_share:
        raise RecipeRefusedError(
            f"an engine GPU needs {weights / GIB:.1f} GiB of weights ({dtype}, TP {tp}) + {one_sequence / GIB:.1f} GiB "
            f"of KV cache for one sequence of {length} tokens, over vLLM's share of {vllm_share / GIB:.1f} GiB "
            f"(gpu_memory_utilization {rollout.gpu_memory_utilization} x {cluster.gpu_memory_gib:g} GiB): raise "
            "actor_rollout_ref.rollout.tensor_model_parallel_size or gpu_memory_utilization, or lower max_model_len"
        )
    bucket = 0.0 if transport == "naive" else rollout.checkpoint_engine.update_weights_bucket_megabytes * 1024**2
    total = vllm_share + ENGINE_BUCKETS * bucket + GPU_OVERHEAD_GIB * GIB
    if total > cluster.gpu_memory_gib * GIB:
        raise RecipeRefusedError(
            f"an engine GPU needs vLLM's {vllm_share / GIB:.1f} GiB + {ENGINE_BUCKETS} transfer buckets of "
            f"{bucket / GIB:.1f} GiB + ~{GPU_OVERHEAD_GIB:g} GiB of CUDA context = {total / GIB:.1f} GiB, more than "
            f"its {cluster.gpu_memory_gib:g} GiB: lower actor_rollout_ref.rollout.gpu_memory_utilization or "
            "checkpoint_engine.update_weights_bucket_megabytes"
        )
    lines = [
        f"engine GPU: weights {weights / GIB:.1f} GiB + KV cache {(vllm_share - weights) / GIB:.1f} GiB "
        f"({(vllm_share - weights) / one_sequence:.1f} sequences of {length} tokens, {length_key}) in vLLM's "
        f"{vllm_share / GIB:.1f} GiB; + {ENGINE_BUCKETS * bucket / GIB:.1f} GiB of transfer buckets; "
        + (
            f"{(cluster.gpu_memory_gib * GIB - total) / GIB:.1f} GiB for the trainer while the engine is awake "
            "(the trainer's own memory is not checked)"
            if colocated
            else f"{(cluster.gpu_memory_gib * GIB - total) / GIB:.1f} GiB spare"
        )
    ]
    if bucket:
        lines.append(
            f"trainer GPU: + {TRAINER_BUCKETS * bucket / GIB:.1f} GiB of transfer buckets during a weight sync"
        )
    return lines


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
