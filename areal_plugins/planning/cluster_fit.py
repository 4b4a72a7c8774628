"""Does a composed recipe fit a declared GPU cluster? Pools, engine replicas, the model, engine and trainer memory.

``areal-plugins check RECIPE --nodes M --gpus-per-node N`` runs this after every startup check
(:mod:`areal_plugins.cli.preflight`): the arithmetic a launch would otherwise discover minutes in, on the
cluster, as a placement group that never schedules or an engine that runs out of memory. It follows verl
0.9.1's own order: the trainer's pool first (``trainer.nnodes`` groups of ``trainer.n_gpus_per_node``), then,
in ``separate``, one placement group per engine replica of ``min(rollout.n_gpus_per_node, TP x DP x PP)`` GPUs.
Then the model (:mod:`areal_plugins.planning.model_shapes`: a ``config.json`` or the shipped table, never a guess),
what vLLM refuses at start (context past the model's positions, heads that tensor parallelism does not divide), an
engine GPU's memory and a trainer GPU's (:mod:`areal_plugins.planning.trainer_memory`). docs/guides/sizing.md states
every formula and where it comes from.
"""

from __future__ import annotations

import importlib.util
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from areal_plugins.config.errors import RecipeRefusedError
from areal_plugins.config.settings import areal_settings
from areal_plugins.planning.hardware import ModelShape
from areal_plugins.planning.model_shapes import KnownModel, UnknownModelError, resolve
from areal_plugins.planning.trainer_memory import (
    TrainerSetup,
    lora_adapter_params,
    trainer_memory,
    vision_block_bytes_per_patch,
)
from areal_plugins.planning.verl_overrides import verl_overrides
from areal_plugins.planning.vision import PROCESSOR_DEFAULT_MAX_PIXELS, VisionShape

GIB = 1024**3
#: Bytes per parameter of the engine's weights, by verl's ``rollout.dtype``.
DTYPE_BYTES = {"bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2, "float32": 4, "fp32": 4}
#: Transfer buffers of a checkpoint engine other than ``naive``, each ``update_weights_bucket_megabytes``: the
#: engine's side holds three (verl's nccl engine sends and receives into two, vLLM's bucketed weight receiver
#: adds one), the trainer's side two (``trainer_memory.TRAINER_BUCKETS``); all outside ``gpu_memory_utilization``.
ENGINE_BUCKETS = 3
#: Memory a GPU needs beside what is counted, per process of ours or verl's on it: CUDA context, NCCL, allocator
#: slack (a round estimate, not a measurement).
GPU_OVERHEAD_GIB = 2.0
#: The CUDA context of verl's ``CheckpointEngineWorker``, a process of its own on each engine GPU beside vLLM's
#: worker (checkpoint engines other than ``naive``): PyTorch measured a CUDA context at 666,632,192 bytes with
#: eager module loading and 287,047,680 with ``CUDA_MODULE_LOADING=LAZY`` (pytorch/pytorch#86509); the larger,
#: since cupy and NCCL load kernels of their own.
CHECKPOINT_ENGINE_CONTEXT_BYTES = 666_632_192
#: A GPU that fits with less than this many GiB spare beyond every counted term is refused (``ArealConfig.check``,
#: default 2 GiB; docs/guides/sizing.md says why that number): the CUDA caching allocator can hold memory it cannot
#: hand out, since a request needs one contiguous free block and live blocks pin the splits around them ("When does
#: fragmentation occur in the CUDA caching allocator?", pytorch/devlogs, 2026-06-01), and how much depends on the
#: order of allocations, which no recipe key gives.
MARGIN_KEY = "areal.check.memory_margin_gib"


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


def fit_cluster(config: Any, cluster: Cluster, model_config: Path | None = None) -> list[str]:
    """Check ``config`` against ``cluster``; return what would run where, one line each (``warning: ...`` for what
    passes but should change: every checkpoint kept, a value verl overrides at run time).

    Args:
        model_config: the model's ``config.json`` (``--model-config``), for a model the table does not hold.

    Raises:
        RecipeRefusedError: a pool or replica that does not fit, a replica size that does not divide the
            engines' GPUs, a model of unknown shape, a context or tensor parallelism vLLM refuses, or an engine
            or trainer GPU whose memory the run exceeds.
    """
    trainer = config.trainer
    rollout = config.actor_rollout_ref.rollout
    areal = areal_settings(config)
    separate = areal.async_trainer and areal.placement == "separate"
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
    if str(trainer.device) == "cpu":
        return [*lines, "memory: not checked (trainer.device=cpu: no GPU memory to fit)", *verl_overrides(config, None)]
    try:
        known = resolve(str(config.actor_rollout_ref.model.path), model_config)
    except UnknownModelError as error:
        raise RecipeRefusedError(str(error)) from None
    lines.append(f"model: {known.shape.name}, {known.shape.params / 1e9:.2f}B parameters{_vision_part(known.shape)}, "
                 f"from {known.origin}")  # fmt: skip
    lines.append(_check_positions(config, known))
    _check_heads(known.shape, tp)
    image_lines, image_tokens = _images(config, known.shape, model_config)
    engine, awake_free = _engine_memory(
        config, cluster, known.shape, tp, transport, colocated=not separate, image_tokens=image_tokens
    )
    trainer_lines = _trainer_memory(config, cluster, known.shape, transport, separate, awake_free, image_tokens)
    overrides = verl_overrides(config, known.shape.max_positions)
    return lines + image_lines + engine + trainer_lines + checkpoint_lines(config, known.shape) + overrides


def _vision_part(model: ModelShape) -> str:
    if model.vision is None:
        return ""
    return (
        f" ({model.decoder_params / 1e9:.2f}B language model + {model.vision_params / 1e9:.2f}B {model.vision.family} "
        "vision tower)"
    )


def processor_max_pixels(config: Any, model_folder: Path | None) -> tuple[int, str] | None:
    """The image processor's ``max_pixels`` and where it comes from: the recipe's
    ``data.mm_processor_kwargs.max_pixels`` (verl hands these kwargs to the processor:
    ``verl/utils/dataset/rl_dataset.py:121, 232-239``, ``verl/experimental/agent_loop/agent_loop.py:243``), else the
    model folder's ``preprocessor_config.json`` (``max_pixels``, or ``size.longest_edge``); None where neither says."""
    kwargs = config.data.get("mm_processor_kwargs") or {}
    if kwargs.get("max_pixels") is not None:
        return int(kwargs["max_pixels"]), "data.mm_processor_kwargs.max_pixels"
    file = model_folder / "preprocessor_config.json" if model_folder is not None else None
    if file is None or not file.is_file():
        return None
    processor = json.loads(file.read_text())
    pixels = processor.get("max_pixels") or (processor.get("size") or {}).get("longest_edge")
    return (int(pixels), str(file)) if pixels else None


def _images(config: Any, model: ModelShape, model_config: Path | None) -> tuple[list[str], int]:
    """A VLM's image tokens: lines saying how many one image of ``max_pixels`` becomes (``warning:`` where the
    prompt cannot hold them, or where ``max_pixels`` is assumed), and that count (0 for a text-only model).

    Image tokens are prompt tokens: verl counts them in ``data.max_prompt_length`` (its dataset's length filter
    tokenizes the processed images, ``verl/utils/dataset/rl_dataset.py:215-241``) and so in the engine's
    ``max_model_len``, and its agent loop fails a multimodal prompt longer than ``rollout.prompt_length``
    (``verl/experimental/agent_loop/agent_loop.py:351-361``) rather than cut an image's tokens.
    """
    vision: VisionShape | None = model.vision
    if vision is None:
        return [], 0
    if model_config is not None:
        given = model_config.expanduser()
        folder: Path | None = given if given.is_dir() else given.parent
    else:
        path = Path(str(config.actor_rollout_ref.model.path)).expanduser()
        folder = path if path.is_dir() else None
    found = processor_max_pixels(config, folder)
    lines = []
    if found is None:
        pixels, source = PROCESSOR_DEFAULT_MAX_PIXELS, "transformers' Qwen2-VL image processor default"
        lines.append(
            f"warning: neither data.mm_processor_kwargs.max_pixels nor a preprocessor_config.json beside the model "
            f"says how large an image may be; sized at {pixels:,} pixels ({source}), and a model's published processor "
            "may allow more (Qwen2.5-VL's: 12,845,056): set data.mm_processor_kwargs.max_pixels"
        )
    else:
        pixels, source = found
    tokens = vision.image_tokens(pixels)
    prompt = int(config.data.max_prompt_length)
    lines.insert(
        0,
        f"images: one of up to {pixels:,} pixels ({source}) is up to {tokens:,} prompt tokens "
        f"({vision.pixels_per_token} pixels a token; {vision.patches(tokens):,} patches of the vision tower), "
        f"counted in data.max_prompt_length={prompt} and so in max_model_len",
    )
    if tokens > prompt:
        lines.append(
            f"warning: an image of {pixels:,} pixels is {tokens:,} prompt tokens, more than data.max_prompt_length="
            f"{prompt}: verl's agent loop fails such a prompt (verl/experimental/agent_loop/agent_loop.py:351-361) "
            f"and data.filter_overlong_prompts drops it: set data.mm_processor_kwargs.max_pixels to at most "
            f"{prompt * vision.pixels_per_token:,} or raise data.max_prompt_length"
        )
    length = config.actor_rollout_ref.rollout.get("max_model_len")
    if length is not None and tokens >= int(length):
        lines.append(
            f"warning: an image of {pixels:,} pixels is {tokens:,} prompt tokens, not fewer than "
            f"actor_rollout_ref.rollout.max_model_len={length}: the engine cannot hold a prompt with such an image and "
            f"one token of answer: raise max_model_len or lower data.mm_processor_kwargs.max_pixels"
        )
    return lines, min(tokens, prompt)


def _check_positions(config: Any, known: KnownModel) -> str:
    """vLLM refuses a ``max_model_len`` past the model's ``max_position_embeddings`` at start; refuse it first."""
    rollout = config.actor_rollout_ref.rollout
    positions = known.shape.max_positions
    sequence = int(config.data.max_prompt_length) + int(config.data.max_response_length)
    if positions is None:
        return f"positions: not checked ({known.origin}; --model-config with its config.json checks them)"
    length = rollout.get("max_model_len")
    if length is not None and int(length) > positions:
        raise RecipeRefusedError(
            f"actor_rollout_ref.rollout.max_model_len={length} is past {known.shape.name}'s max_position_embeddings "
            f"({positions}), which vLLM refuses at start: lower max_model_len to at most {positions}"
        )
    if sequence > positions:
        raise RecipeRefusedError(
            f"data.max_prompt_length + data.max_response_length = {sequence} tokens is past {known.shape.name}'s "
            f"max_position_embeddings ({positions}): lower data.max_response_length (or max_prompt_length)"
        )
    return f"positions: {length or sequence} of {known.shape.name}'s {positions} (max_position_embeddings)"


def _check_heads(model: ModelShape, tp: int) -> None:
    """vLLM splits attention heads over tensor parallel ranks: the heads must divide, and the KV heads divide or
    be replicated whole (vLLM's ``ModelConfig.verify_with_parallel_config`` and its QKV layer)."""
    key = "actor_rollout_ref.rollout.tensor_model_parallel_size"
    if model.heads % tp:
        raise RecipeRefusedError(
            f"{key}={tp} does not divide {model.name}'s {model.heads} attention heads, which vLLM refuses at start: "
            f"choose a divisor of {model.heads}"
        )
    if (model.kv_heads % tp) if tp <= model.kv_heads else (tp % model.kv_heads):
        raise RecipeRefusedError(
            f"{key}={tp} neither divides {model.name}'s {model.kv_heads} KV heads nor is a multiple of them, which "
            "vLLM refuses at start: choose a divisor or a multiple of the KV heads"
        )


def _bytes_per_param(dtype: Any, key: str) -> int:
    try:
        return DTYPE_BYTES[str(dtype)]
    except KeyError:
        raise RecipeRefusedError(f"{key}={dtype}: check knows {', '.join(DTYPE_BYTES)}") from None


def _engine_memory(
    config: Any, cluster: Cluster, model: ModelShape, tp: int, transport: str, colocated: bool, image_tokens: int = 0
) -> tuple[list[str], float]:
    """Lines about an engine GPU, and what is left of it beside the awake engine (for a colocated trainer).

    A VLM's vision tower is in the weights (:attr:`ModelShape.params`); vLLM's start profiles its encoder on the
    largest image (``image_tokens`` of the prompt) inside its share, so one vision block's activations over that
    image's patches (:func:`~areal_plugins.planning.trainer_memory.vision_block_bytes_per_patch`, split over TP as
    vLLM's vision layers are) come out of the KV cache."""
    rollout = config.actor_rollout_ref.rollout
    dtype = str(rollout.get("dtype") or "bfloat16")
    engine_bytes = _bytes_per_param(dtype, "actor_rollout_ref.rollout.dtype")
    weights = model.params * engine_bytes / tp
    gpu = cluster.gpu_memory_gib * GIB
    vllm_share = float(rollout.gpu_memory_utilization) * gpu
    # vLLM refuses to start unless one sequence of max_model_len fits its KV cache (null: the model's maximum).
    length = rollout.get("max_model_len") or model.max_positions
    length_key = "actor_rollout_ref.rollout.max_model_len"
    if length is None:
        length = int(config.data.max_prompt_length) + int(config.data.max_response_length)
        length_key = "prompt + response: set rollout.max_model_len, or vLLM sizes for the model's maximum"
    heads_per_gpu = math.ceil(model.kv_heads / tp)  # a KV head is not split: TP beyond the KV heads replicates them
    # K and V of every layer, in the engine's dtype (vLLM's kv_cache_dtype "auto", which verl leaves: the model's)
    one_sequence = 2 * model.layers * heads_per_gpu * model.head_size * engine_bytes * int(length)
    encoder = (
        model.vision.patches(image_tokens) * vision_block_bytes_per_patch(model.vision, engine_bytes) / tp
        if model.vision is not None
        else 0.0
    )
    encoder_part = f"{encoder / GIB:.1f} GiB of vision activations for one image + " if encoder else ""
    if weights + encoder + one_sequence > vllm_share:
        raise RecipeRefusedError(
            f"an engine GPU needs {weights / GIB:.1f} GiB of weights ({dtype}, TP {tp}) + {encoder_part}"
            f"{one_sequence / GIB:.1f} GiB "
            f"of {dtype} KV cache for one sequence of {length} tokens, over vLLM's share of {vllm_share / GIB:.1f} GiB "
            f"(gpu_memory_utilization {rollout.gpu_memory_utilization} x {cluster.gpu_memory_gib:g} GiB): raise "
            "actor_rollout_ref.rollout.tensor_model_parallel_size or gpu_memory_utilization, or lower max_model_len"
        )
    bucket = 0.0 if transport == "naive" else rollout.checkpoint_engine.update_weights_bucket_megabytes * 1024**2
    # verl's receiver (merge_weight_chunks) assembles a tensor larger than a bucket in a full-size buffer of the
    # dtype the trainer sends: its fsdp_config.model_dtype (fp32 by default), the embedding the largest
    sent = (
        model.vocab
        * model.hidden
        * _bytes_per_param(
            config.actor_rollout_ref.actor.fsdp_config.get("model_dtype", "fp32"),
            "actor_rollout_ref.actor.fsdp_config.model_dtype",
        )
    )
    assembled = sent if bucket and sent > bucket else 0.0
    context = CHECKPOINT_ENGINE_CONTEXT_BYTES if bucket else 0.0
    total = vllm_share + ENGINE_BUCKETS * bucket + assembled + context + GPU_OVERHEAD_GIB * GIB
    if total > gpu:
        raise RecipeRefusedError(
            f"an engine GPU needs vLLM's {vllm_share / GIB:.1f} GiB + {ENGINE_BUCKETS} transfer buckets of "
            f"{bucket / GIB:.1f} GiB + {assembled / GIB:.1f} GiB for the largest tensor verl's receiver assembles "
            f"+ {context / GIB:.2f} GiB of the checkpoint engine's CUDA context + ~{GPU_OVERHEAD_GIB:g} GiB of "
            f"vLLM's = {total / GIB:.1f} GiB, more than its {cluster.gpu_memory_gib:g} GiB: lower "
            "actor_rollout_ref.rollout.gpu_memory_utilization or checkpoint_engine.update_weights_bucket_megabytes"
        )
    spare = gpu - total
    margin = areal_settings(config).check.memory_margin_gib * GIB
    if not colocated and spare < margin:
        raise RecipeRefusedError(
            f"an engine GPU needs vLLM's {vllm_share / GIB:.1f} GiB + {(total - vllm_share) / GIB:.1f} GiB beside it "
            f"(transfer buckets, the assembled over-bucket tensor, CUDA contexts) = {total / GIB:.1f} GiB: "
            f"{spare / GIB:.1f} GiB spare of {cluster.gpu_memory_gib:g}, under the {MARGIN_KEY}={margin / GIB:g} GiB "
            "check keeps for what it cannot count: lower actor_rollout_ref.rollout.gpu_memory_utilization or "
            f"checkpoint_engine.update_weights_bucket_megabytes, or lower {MARGIN_KEY} (0: fit to the byte)"
        )
    transfer = (
        f"+ {ENGINE_BUCKETS * bucket / GIB:.1f} GiB of transfer buckets + {assembled / GIB:.1f} GiB assembled "
        f"over-bucket tensor + {context / GIB:.2f} GiB checkpoint-engine context; "
        if bucket
        else ""
    )
    kv = vllm_share - weights - encoder
    line = (
        f"engine GPU: weights {weights / GIB:.1f} GiB + {encoder_part}KV cache {kv / GIB:.1f} GiB "
        f"({kv / one_sequence:.1f} sequences of {length} tokens, {length_key}) in vLLM's "
        f"{vllm_share / GIB:.1f} GiB; {transfer}"
        + f"{spare / GIB:.1f} GiB "
        + ("for the trainer while the engine is awake" if colocated else "spare")
    )
    return [line], spare


def _trainer_memory(
    config: Any,
    cluster: Cluster,
    model: ModelShape,
    transport: str,
    separate: bool,
    awake_free: float,
    image_tokens: int = 0,
) -> list[str]:
    """Refuse a trainer GPU the update or the weight sync overfills; else say what it holds.

    A VLM's micro-batch also runs its vision tower over the images: each sequence with ``image_tokens`` of them
    (one image of ``max_pixels``, at most the prompt), as many sequences as a micro-batch holds at full length
    (``ppo_micro_batch_size_per_gpu``, or the token budget over prompt + response)."""
    actor = config.actor_rollout_ref.actor
    if str(actor.strategy) not in ("fsdp", "fsdp2"):
        return [f"trainer GPU: not checked (actor.strategy={actor.strategy}: check sizes verl's FSDP engine)"]
    fsdp = actor.fsdp_config
    trainer_gpus = int(config.trainer.nnodes) * int(config.trainer.n_gpus_per_node)
    fsdp_size = int(fsdp.get("fsdp_size", -1) or -1)
    if actor.get("use_dynamic_bsz"):
        tokens, tokens_key = int(actor.ppo_max_token_len_per_gpu), "actor_rollout_ref.actor.ppo_max_token_len_per_gpu"
    else:
        tokens = int(actor.ppo_micro_batch_size_per_gpu) * (
            int(config.data.max_prompt_length) + int(config.data.max_response_length)
        )
        tokens_key = "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"
    megabytes = int(config.actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes)
    bucket = 0 if transport == "naive" else megabytes << 20
    dtype_key = "actor_rollout_ref.actor.fsdp_config.model_dtype"
    # The compute dtype: verl's FSDPEngine casts the parameters to mixed_precision.param_dtype for the forward and
    # backward (bf16 when mixed_precision is unset) and reduces gradients in its reduce_dtype (fp32 when unset).
    mixed = fsdp.get("mixed_precision") or {}
    compute = str(mixed.get("param_dtype", "bf16"))
    mixed_key = "actor_rollout_ref.actor.fsdp_config.mixed_precision"
    padding_note = ""
    if actor.get("use_dynamic_bsz") and not config.actor_rollout_ref.model.get("use_remove_padding", False):
        areal = areal_settings(config)
        if not (areal.enable and areal.micro_batch.max_tokens is not None):
            # verl's own token-budget micro-batches count real tokens, then pad each to its longest sequence
            padding_note = (
                f" (padding not counted: verl pads each micro-batch of up to {tokens} real tokens to its longest "
                "sequence; set actor_rollout_ref.model.use_remove_padding=true, or areal.micro_batch.max_tokens, "
                "which counts padded tokens)"
            )
    setup = TrainerSetup(
        shard_gpus=fsdp_size if fsdp_size > 0 else trainer_gpus,
        param_bytes=_bytes_per_param(fsdp.get("model_dtype", "fp32"), dtype_key),
        micro_batch_tokens=tokens,
        gradient_checkpointing=bool(config.actor_rollout_ref.model.get("enable_gradient_checkpointing", False)),
        offload_policy=bool(fsdp.get("offload_policy", False)),
        param_offload=bool(fsdp.get("param_offload", False)),
        optimizer_offload=bool(fsdp.get("optimizer_offload", False)),
        bucket_bytes=bucket,
        compute_bytes=_bytes_per_param(compute, f"{mixed_key}.param_dtype"),
        reduce_bytes=_bytes_per_param(mixed.get("reduce_dtype", "fp32"), f"{mixed_key}.reduce_dtype"),
        image_patches=_micro_batch_patches(config, model, image_tokens),
        lora_params=_lora_params(config, model),
    )
    memory = trainer_memory(model, setup)
    gpu = cluster.gpu_memory_gib * GIB
    # our trainer worker's CUDA context; colocated, the sleeping engine keeps its own beside it
    overhead = GPU_OVERHEAD_GIB * GIB * (1 if separate else 2)
    dtype = str(fsdp.get("model_dtype", "fp32"))
    where = "on the CPU (offload_policy)" if setup.offload_policy else f"over {setup.shard_gpus} GPU(s)"
    update = (
        f"{memory.state / GIB:.1f} GiB of {dtype} parameters, gradients and Adam m, v {where} + "
        f"{memory.logits / GIB:.1f} GiB {compute} logits of a {tokens}-token micro-batch{padding_note} + "
        f"{memory.activations / GIB:.1f} GiB {compute} activations "
        f"({'with' if setup.gradient_checkpointing else 'without'} gradient checkpointing) + "
        + (
            f"{memory.expert_copies / GIB:.2f} GiB {compute} top-{model.experts_per_token} expert dispatch and combine "
            f"copies + {memory.router_probs / GIB:.2f} GiB fp32 router probabilities of "
            + ("the recomputed layer + " if setup.gradient_checkpointing else f"{model.layers} layers + ")
            if model.experts
            else ""
        )
        + (
            f"{memory.vision_activations / GIB:.1f} GiB {compute} vision-tower activations of "
            f"{setup.image_patches:,} image patches + "
            if memory.vision_activations
            else ""
        )
        + f"{memory.gathered_unit / GIB:.1f} GiB gathered FSDP unit = {memory.update_peak / GIB:.1f} GiB"
    )
    sync = (
        f"{(memory.parameters + memory.optimizer) / GIB:.1f} GiB of parameters and Adam + "
        f"{memory.sync_tensor / GIB:.2f} GiB gathered largest tensor + {memory.sync_buckets / GIB:.1f} GiB of "
        f"buckets = {memory.sync_peak / GIB:.1f} GiB"
    )
    context = f"~{overhead / GIB:g} GiB of CUDA context" + ("" if separate else " (ours and the sleeping engine's)")
    rollout = config.actor_rollout_ref.rollout
    # colocated without free_cache_engine, the engine's weights and KV cache stay on the GPU while the trainer trains
    kept = 0.0 if separate or rollout.get("free_cache_engine", True) else float(rollout.gpu_memory_utilization) * gpu
    if kept:
        context += f" + {kept / GIB:.1f} GiB vLLM keeps asleep (free_cache_engine=false)"
        overhead += kept
    at_update = memory.update_peak >= memory.sync_peak
    remedy = (
        f"add trainer GPUs (trainer.nnodes x n_gpus_per_node; {setup.shard_gpus} shard the state now), set "
        "actor_rollout_ref.actor.fsdp_config.offload_policy=true (FSDP2: the state stays on the CPU while training), "
        "or lower "
        + (f"{tokens_key} ({tokens} tokens a micro-batch)" if at_update else "update_weights_bucket_megabytes")
        + ("; or set actor_rollout_ref.rollout.free_cache_engine=true" if kept else "")
    )
    phase = f"update ({update}, + {context})" if at_update else f"weight sync ({sync}, + {context})"
    if memory.peak + overhead > gpu:
        raise RecipeRefusedError(
            f"a trainer GPU needs {(memory.peak + overhead) / GIB:.1f} GiB at the {phase}, more than its "
            f"{cluster.gpu_memory_gib:g} GiB: {remedy}"
        )
    margin = areal_settings(config).check.memory_margin_gib * GIB
    if gpu - memory.peak - overhead < margin:
        raise RecipeRefusedError(
            f"a trainer GPU needs {(memory.peak + overhead) / GIB:.1f} GiB at the {phase}: "
            f"{(gpu - memory.peak - overhead) / GIB:.1f} GiB spare of {cluster.gpu_memory_gib:g}, under the "
            f"{MARGIN_KEY}={margin / GIB:g} GiB check keeps for what it cannot count (allocator fragmentation): "
            f"{remedy}; or lower {MARGIN_KEY} (0: fit to the byte)"
        )
    if not separate and memory.resident_between_updates + margin > awake_free:
        raise RecipeRefusedError(
            f"while the engine is awake, a trainer GPU keeps {memory.resident_between_updates / GIB:.1f} GiB of "
            f"{dtype} parameters and Adam state beside it, + the {MARGIN_KEY}={margin / GIB:g} GiB margin, more than "
            f"the {awake_free / GIB:.1f} GiB the engine leaves: set "
            "actor_rollout_ref.actor.fsdp_config.param_offload=true and optimizer_offload=true, or lower "
            "actor_rollout_ref.rollout.gpu_memory_utilization"
        )
    return [
        f"trainer GPU: update {update}; weight sync {sync}; + {context}: "
        f"{(gpu - memory.peak - overhead) / GIB:.1f} GiB spare of {cluster.gpu_memory_gib:g}"
    ]


def _micro_batch_patches(config: Any, model: ModelShape, image_tokens: int) -> int:
    """The image patches one training micro-batch sends through the vision tower (0 for a text-only model)."""
    if model.vision is None or not image_tokens:
        return 0
    actor = config.actor_rollout_ref.actor
    sequence = int(config.data.max_prompt_length) + int(config.data.max_response_length)
    if actor.get("use_dynamic_bsz"):
        sequences = max(1, int(actor.ppo_max_token_len_per_gpu) // sequence)
    else:
        sequences = int(actor.ppo_micro_batch_size_per_gpu)
    return sequences * model.vision.patches(image_tokens)


def checkpoint_lines(config: Any, model: ModelShape) -> list[str]:
    """What the run's checkpoints take on disk: one checkpoint's size, how many verl keeps, the total; a line
    starting ``warning:`` when it keeps every one.

    verl's FSDP checkpoint (``verl/utils/checkpoint/fsdp_checkpoint_manager.py:310-361``, 0.9.1): every rank saves
    its shard of the parameters (``model.state_dict()`` under ``SHARDED_STATE_DICT``, in ``fsdp_config.model_dtype``)
    and of the optimizer's state (``optimizer.state_dict()``: AdamW's ``exp_avg`` and ``exp_avg_sq``, each like the
    parameter), as ``actor.checkpoint.save_contents`` lists them (model, optimizer, extra by default); the extras
    (learning-rate scheduler and RNG per rank, the TaskRunner's ``data.pt``, the tokenizer) are kilobytes to
    megabytes, not counted. verl saves every ``trainer.save_freq`` steps and at the last
    (``verl/trainer/ppo/v1/trainer_base.py:481-482``) and keeps ``trainer.max_actor_ckpt_to_keep`` of them (null:
    all; ``trainer_base.py:964-966``).
    """
    trainer = config.trainer
    freq = int(trainer.get("save_freq", -1) or -1)
    if freq <= 0:
        return [f"checkpoints: none (trainer.save_freq={freq})"]
    actor = config.actor_rollout_ref.actor
    contents = [str(c) for c in (actor.get("checkpoint") or {}).get("save_contents", ["model", "optimizer", "extra"])]
    param_bytes = _bytes_per_param(
        actor.fsdp_config.get("model_dtype", "fp32"), "actor_rollout_ref.actor.fsdp_config.model_dtype"
    )
    copies = ("model" in contents) + 2 * ("optimizer" in contents)  # parameters; Adam's exp_avg and exp_avg_sq
    size = model.params * param_bytes * copies
    what = " + ".join(
        part
        for part, present in (
            (f"parameters {model.params * param_bytes / 1e9:.1f} GB", "model" in contents),
            (f"Adam m, v {2 * model.params * param_bytes / 1e9:.1f} GB", "optimizer" in contents),
        )
        if present
    )
    steps = trainer.get("total_training_steps")
    saves = None if steps is None else int(steps) // freq + (1 if int(steps) % freq else 0)
    keep = trainer.get("max_actor_ckpt_to_keep")
    kept = saves if keep is None else (int(keep) if saves is None else min(int(keep), saves))
    count = (
        f"all {saves} saves of trainer.total_training_steps={steps} (trainer.max_actor_ckpt_to_keep: null)"
        if keep is None and saves is not None
        else "every save (trainer.max_actor_ckpt_to_keep: null; trainer.total_training_steps unset)"
        if keep is None
        else f"{kept} kept (trainer.max_actor_ckpt_to_keep={keep})"
    )
    total = f"{kept * size / 1e9:.1f} GB" if kept is not None else "growing with every save"
    lines = [
        f"checkpoints: {size / 1e9:.1f} GB each ({model.params / 1e9:.2f}B {param_bytes * 8}-bit: {what or 'none'}"
        f"; verl's extras not counted) every {freq} steps, {count}: {total} on disk, under trainer.default_local_dir"
    ]
    if keep is None:
        lines.append(
            f"warning: verl keeps every checkpoint of {size / 1e9:.1f} GB ({total}): set "
            "trainer.max_actor_ckpt_to_keep (e.g. 2: the last and the one before it)"
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


def _lora_params(config: Any, model: ModelShape) -> int:
    """The recipe's LoRA adapter's parameters (0 without LoRA, or merged weights trained as LoRA all the same)."""
    from areal_plugins.builtin.validation import lora_rank

    rank = lora_rank(config)
    if rank <= 0:
        return 0
    return lora_adapter_params(model, rank, config.actor_rollout_ref.model.get("target_modules", "all-linear"))
