"""What one trainer GPU holds under verl's FSDP/FSDP2 engine: the sharded state, a micro-batch's transients, and a
weight sync's gathered tensor and buckets. Pure arithmetic (no verl, no torch); ``areal-plugins check`` reads the
numbers from the recipe (:mod:`areal_plugins.planning.cluster_fit`). docs/guides/sizing.md derives each term and
names its source.

Two phases peak apart, and the GPU must hold the larger:

- **update** (``actor.update_policy``): parameters, gradients and Adam's two moments, each sharded over the FSDP
  group, plus the FSDP unit gathered for compute, the micro-batch's activations and its logits (and, for a mixture
  of experts, the dispatch/combine copies and router probabilities of the layers it holds);
- **weight sync** (after ``optimizer.step``, gradients freed): parameters and Adam, plus the full-size tensor
  verl's ``get_per_tensor_param`` gathers (``DTensor.full_tensor()``) and the checkpoint engine's buckets.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from areal_plugins.planning.hardware import ModelShape
from areal_plugins.planning.vision import VisionShape

#: The compute dtype is ``fsdp_config.mixed_precision.param_dtype`` (verl's ``FSDPEngine._build_fsdp_module``: bf16
#: when ``mixed_precision`` is unset; FSDP casts the ``model_dtype`` parameters to it and verl's ``forward_step``
#: autocasts to it, or skips autocast for fp32); ``fsdp_config.dtype`` is read only by verl's Megatron engine.
#:
#: A token's activations per decoder layer, measured: autograd's saved tensors of transformers' Qwen2 decoder layer
#: (sdpa attention) are, to the byte, ``c·(6·h + 4·I + 2·kv_heads·head_dim) + 4·(2·h + heads) + 8`` bytes for a
#: compute dtype of ``c`` bytes (bf16: 20·h + 8·I + 4·kv_heads·head_dim + 4·heads + 8; fp32: 32·h + 16·I +
#: 8·kv_heads·head_dim + 4·heads + 8; tests/unit/test_trainer_memory.py measures both with
#: ``torch.autograd.graph.saved_tensors_hooks``): in the compute dtype the norms' inputs and outputs, q, the attention
#: output and the residuals (6 x h: 4 x h + 2 x heads·head_dim, as q and the attention output are heads x head_dim
#: wide, which Qwen2's h is and Qwen3's need not be; measured both ways), the gated MLP's gate, up, activation and
#: product (4 x I), k and v after the rotary embedding; always in fp32 the norms' upcast inputs (2 x h, the same
#: tensors as their inputs in fp32), the attention's log-sum-exp per head, and the norms' two scales (8 bytes).
#: Korthikanti et al. 2022 (arXiv 2205.05198) §4.1 count 34·h bytes for a bf16 GPT layer of 4h MLP width (attention
#: 11h, norms 4h, MLP 19h), the same order.
ACT_HIDDEN_ELEMENTS = 4
ACT_QO_ELEMENTS = 2
ACT_WIDTH_ELEMENTS = 4
ACT_KV_ELEMENTS = 2
ACT_FP32_HIDDEN_ELEMENTS = 2
ACT_FP32_HEAD_ELEMENTS = 1
ACT_LAYER_CONSTANT = 8
FP32_BYTES = 4
#: Qwen3's per-head q and k RMSNorms (``Qwen3Attention.q_norm``, ``k_norm``) keep, a token, their inputs in the
#: compute dtype, the inputs' fp32 upcasts and one fp32 scale per head: c·(heads + kv_heads)·head_dim +
#: 4·(heads + kv_heads)·(head_dim + 1) bytes (Qwen3-30B-A3B, bf16: 9,216 + 18,576 = 27,792), measured to the byte on
#: transformers' Qwen3 in bf16 and fp32 (tests/unit/test_trainer_memory.py).
QK_NORM_FP32_SCALES = 1
#: After the layers: the final norm and the output head's input, 2·h elements in the compute dtype + h in fp32 a
#: token (measured as above: 8·h bytes in bf16, 12·h in fp32).
ACT_FINAL_ELEMENTS = 2
ACT_FINAL_FP32_ELEMENTS = 1
#: With gradient checkpointing each layer keeps only its input (h elements of the compute dtype a token; measured),
#: and the backward recomputes one layer at a time: L·c·h + one layer's activations (Korthikanti et al. §5, full
#: recompute).
CHECKPOINT_INPUT_ELEMENTS = 1
#: A mixture of experts' layer keeps, a token, what transformers 5's Qwen3-MoE forward allocates for autograd beyond
#: the dense terms above (``models/qwen3_moe/modeling_qwen3_moe.py``; the experts run through
#: ``integrations/moe.py:grouped_mm_experts_forward``, transformers' default ``experts_implementation``, or the eager
#: per-expert loop ``Qwen3MoeExperts.forward``, which saves the same two copies):
#:
#: - **dispatch**: ``hidden_states[perm // top_k]`` (eager: ``hidden_states[token_idx]`` per expert) copies each token's
#:   hidden state once per routed expert, k·h elements in the compute dtype, saved as the up projection's input;
#: - **combine**: the down projection's output, k·h a token, saved by ``proj_out * sample_weights`` (eager:
#:   ``current_hidden_states * top_k_weights[...]``) for the routing weights' gradient;
#:
#: so ``MOE_COPIES`` (2) x k x h x c bytes a token (Qwen3-30B-A3B, bf16: 2 x 8 x 2048 x 2 = 65,536 = 64 KiB). The
#: gate, up, activation and product of the routed experts are the dense ``ACT_WIDTH_ELEMENTS`` x k·moe_intermediate.
#: - **router**: ``Qwen3MoeTopKRouter.forward`` computes ``softmax(router_logits, dtype=float)``, whose fp32 output
#:   (tokens x experts) autograd keeps for the softmax's backward: ``ROUTER_PROB_BYTES`` x experts a token
#:   (Qwen3-30B-A3B: 512). verl's FSDP path never asks for ``output_router_logits`` (the aux loss), so no layer's
#:   logits outlive it.
#:
#: Both are a layer's: every layer without gradient checkpointing, the one recomputed layer with it. Measured with
#: autograd's saved-tensor hooks on a Qwen3-MoE built in code (tests/unit/test_trainer_memory.py): a layer grows by
#: 2·h·c + 4·moe_intermediate·c + ~39 bytes of routing indices per routed expert, and by 4 bytes per expert. Not
#: counted: those indices (int64 ``perm``, ``inv_perm``, top-k; ~39·k bytes a token a layer, under 1% of the copies).
MOE_COPIES = 2
ROUTER_PROB_BYTES = 4
#: The logits' bytes per token and vocabulary entry at their peak in the backward, by the compute dtype's bytes,
#: measured on verl's ``logprobs_from_logits_v2`` (the path without flash-attention's cross-entropy, or with
#: ``VERL_DISABLE_FLASH_ATTN_CE=1``): bf16 keeps one row's ``log_softmax`` output at a time for the backward (2) and
#: the logits' gradient (2): 4.3 measured; fp32 takes its ``logsumexp`` path, which keeps the logits themselves (4),
#: and the backward adds the gather's gradient and the stacked ``logsumexp`` gradients before summing them (4 + 4):
#: 11.9 measured (tests/unit/test_trainer_memory_measured.py). flash-attention's cross-entropy, verl's other path,
#: keeps the logits and writes their gradient in place: no more than these.
LOGIT_BYTES = {2: 4, 4: 12}
#: An FSDP unit gathered for compute: its parameters in the compute dtype twice (the unit computing and the one FSDP
#: prefetches) and its unsharded gradient in ``reduce_dtype`` (fp32 by verl's default) before the reduce-scatter.
GATHERED_UNIT_COPIES = 2
#: Transfer buffers on a trainer GPU during a weight sync by a checkpoint engine other than ``naive``: verl's
#: nccl engine sends from one bucket while it fills the other (``NCCLCheckpointEngine``: "the device memory
#: overhead is 2 * bucket_size").
TRAINER_BUCKETS = 2


@dataclass(frozen=True)
class TrainerSetup:
    """What the recipe says about one trainer GPU's work (every field read by ``cluster_fit``)."""

    shard_gpus: int  # the FSDP group: fsdp_config.fsdp_size, or every trainer GPU (-1)
    param_bytes: int  # fsdp_config.model_dtype: fp32 4 (verl's default: fp32 master weights), bf16 2
    micro_batch_tokens: int  # ppo_max_token_len_per_gpu, or ppo_micro_batch_size_per_gpu x (prompt + response)
    gradient_checkpointing: bool  # model.enable_gradient_checkpointing
    offload_policy: bool = False  # FSDP2 CPUOffloadPolicy: parameters, gradients and Adam stay on the CPU
    param_offload: bool = False  # on the CPU between phases only: verl loads them back to train
    optimizer_offload: bool = False
    bucket_bytes: int = 0  # checkpoint_engine.update_weights_bucket_megabytes; 0 for naive (no buckets)
    compute_bytes: int = 2  # fsdp_config.mixed_precision.param_dtype: bf16 or fp16 2 (verl's default), fp32 4
    reduce_bytes: int = 4  # fsdp_config.mixed_precision.reduce_dtype: fp32 4 (verl's default), bf16 2
    image_patches: int = 0  # a VLM: the patches its vision tower encodes for one micro-batch's images
    lora_params: int = 0  # LoRA: the adapter's parameters (lora_adapter_params); the base is frozen

    def __post_init__(self) -> None:
        if self.compute_bytes not in LOGIT_BYTES:
            raise ValueError(f"compute_bytes={self.compute_bytes}: sized are {sorted(LOGIT_BYTES)} (16- and 32-bit)")


@dataclass(frozen=True)
class TrainerMemory:
    """Bytes on one trainer GPU, term by term."""

    parameters: float
    gradients: float
    optimizer: float
    gathered_unit: float
    activations: float
    logits: float
    expert_copies: float  # a MoE's dispatch and combine copies of the layers it holds (0 for a dense model)
    router_probs: float  # a MoE's fp32 router probabilities of the layers it holds (0 for a dense model)
    sync_tensor: float
    sync_buckets: float
    resident_between_updates: float
    vision_activations: float = 0.0  # a VLM's vision tower over the micro-batch's image patches

    @property
    def state(self) -> float:
        return self.parameters + self.gradients + self.optimizer

    @property
    def update_peak(self) -> float:
        return (
            self.state
            + self.gathered_unit
            + self.activations
            + self.logits
            + self.expert_copies
            + self.router_probs
            + self.vision_activations
        )

    @property
    def sync_peak(self) -> float:
        return self.parameters + self.optimizer + self.sync_tensor + self.sync_buckets

    @property
    def peak(self) -> float:
        return max(self.update_peak, self.sync_peak)


def layer_activation_bytes_per_token(model: ModelShape, compute_bytes: int = 2) -> int:
    """One decoder layer's saved activations for one token, in a compute dtype of ``compute_bytes`` (see ``ACT_*``)."""
    normed_heads = (model.heads + model.kv_heads) if model.qk_norm else 0
    return (
        compute_bytes
        * (
            ACT_HIDDEN_ELEMENTS * model.hidden
            + ACT_QO_ELEMENTS * model.heads * model.head_size
            + ACT_WIDTH_ELEMENTS * model.active_mlp_width
            + ACT_KV_ELEMENTS * model.kv_heads * model.head_size
            + normed_heads * model.head_size
        )
        + FP32_BYTES * (ACT_FP32_HIDDEN_ELEMENTS * model.hidden + ACT_FP32_HEAD_ELEMENTS * model.heads)
        + FP32_BYTES * normed_heads * (model.head_size + QK_NORM_FP32_SCALES)
        + ACT_LAYER_CONSTANT
    )


def moe_bytes_per_token(model: ModelShape, compute_bytes: int = 2) -> tuple[int, int]:
    """A MoE layer's dispatch-and-combine copies and its router probabilities for one token, in bytes (see
    ``MOE_COPIES``); (0, 0) for a dense model."""
    if not model.experts:
        return 0, 0
    return MOE_COPIES * model.experts_per_token * model.hidden * compute_bytes, ROUTER_PROB_BYTES * model.experts


def held_layers(model: ModelShape, gradient_checkpointing: bool) -> int:
    """The layers whose activations are alive at once in the backward: one (recomputed) with gradient checkpointing,
    every layer without."""
    return 1 if gradient_checkpointing else model.layers


def activation_bytes_per_token(model: ModelShape, gradient_checkpointing: bool, compute_bytes: int = 2) -> int:
    """Activations one token leaves for the backward, over every layer and the head (see ``ACT_*``); a MoE's expert
    copies and router probabilities are :func:`moe_bytes_per_token`'s, apart."""
    one_layer = layer_activation_bytes_per_token(model, compute_bytes)
    final = (compute_bytes * ACT_FINAL_ELEMENTS + FP32_BYTES * ACT_FINAL_FP32_ELEMENTS) * model.hidden
    if gradient_checkpointing:
        return model.layers * CHECKPOINT_INPUT_ELEMENTS * compute_bytes * model.hidden + one_layer + final
    return model.layers * one_layer + final


#: A vision merger's activations a patch, in compute-dtype elements of the tower's width: its norm's input and output
#: (2), the first linear's output and its GELU's (2 x merge² x width over merge² patches: 2). Counted by hand from
#: transformers' ``Qwen2_5_VLPatchMerger`` / ``Qwen3VLVisionPatchMerger`` forward, not measured.
VISION_MERGER_ELEMENTS = 4


def vision_block_bytes_per_patch(vision: VisionShape, compute_bytes: int = 2) -> int:
    """One vision block's activations for one image patch.

    A Qwen vision block is a decoder layer in shape (a norm, multi-head attention with as many KV heads as heads, a
    norm, an MLP), so its bytes are :func:`layer_activation_bytes_per_token`'s, measured on Qwen2's decoder layer,
    for a layer of the tower's width; an fc1/fc2 MLP (Qwen2-VL, Qwen3-VL) keeps fc1's output and its activation,
    2 x its width where a gated one keeps 4, so it enters at half its width.
    """
    width = vision.intermediate if vision.gated_mlp else vision.intermediate // 2
    block = ModelShape("vision block", vision.hidden, vision.depth, vision.heads, vision.heads, width, vocab=0)
    return layer_activation_bytes_per_token(block, compute_bytes)


def vision_activation_bytes_per_patch(vision: VisionShape, gradient_checkpointing: bool, compute_bytes: int = 2) -> int:
    """Activations one image patch leaves for the backward in the vision tower: every block's
    (:func:`vision_block_bytes_per_patch`) and the merger's; with gradient checkpointing (transformers' vision blocks
    are ``GradientCheckpointingLayer``s) each block keeps its input and one is recomputed, as the decoder's layers."""
    one_block = vision_block_bytes_per_patch(vision, compute_bytes)
    merger = VISION_MERGER_ELEMENTS * vision.hidden * compute_bytes
    if gradient_checkpointing:
        return vision.depth * CHECKPOINT_INPUT_ELEMENTS * compute_bytes * vision.hidden + one_block + merger
    return vision.depth * one_block + merger


#: The linear modules of a dense decoder layer, by the names peft targets (verl's ``target_modules: all-linear``
#: resolves to all seven; the output layer is never one).
LINEAR_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def lora_adapter_params(model: ModelShape, rank: int, target_modules: Any = "all-linear") -> int:
    """A LoRA adapter's parameters: ``rank x (in + out)`` for each targeted linear module of each layer (``lora_A``
    is rank x in, ``lora_B`` out x rank). ``target_modules``: verl's key, ``all-linear`` or a list of names."""
    attention, kv = model.heads * model.head_size, model.kv_heads * model.head_size
    h, width = model.hidden, model.intermediate
    sides = {
        "q_proj": h + attention,
        "k_proj": h + kv,
        "v_proj": h + kv,
        "o_proj": attention + h,
        "gate_proj": h + width,
        "up_proj": h + width,
        "down_proj": width + h,
    }
    names = LINEAR_MODULES if target_modules in (None, "all-linear") else [str(name) for name in target_modules]
    unknown = sorted(set(names) - set(sides))
    if unknown:
        raise ValueError(
            f"actor_rollout_ref.model.target_modules names {unknown}: sized are {list(LINEAR_MODULES)} or all-linear"
        )
    return model.layers * rank * sum(sides[name] for name in set(names))


def trainer_memory(model: ModelShape, setup: TrainerSetup) -> TrainerMemory:
    """Each term of a trainer GPU's memory (bytes); docs/guides/sizing.md gives the formulas."""
    shard = (model.params + setup.lora_params) / setup.shard_gpus
    # Under LoRA only the adapter trains: gradients and Adam's moments are the adapter's, the base is held frozen.
    trained = setup.lora_params / setup.shard_gpus if setup.lora_params else shard
    on_gpu = 0.0 if setup.offload_policy else 1.0
    parameters = shard * setup.param_bytes * on_gpu
    gradients = trained * setup.param_bytes * on_gpu  # FSDP keeps gradients in the parameters' dtype
    optimizer = 2 * trained * setup.param_bytes * on_gpu  # torch AdamW: exp_avg, exp_avg_sq, like the parameter
    unit = max(model.layer_params, model.vocab * model.hidden)  # verl wraps each layer, embedding and head apart
    tokens = setup.micro_batch_tokens
    copies, router = moe_bytes_per_token(model, setup.compute_bytes)
    layers = held_layers(model, setup.gradient_checkpointing)
    return TrainerMemory(
        parameters=parameters,
        gradients=gradients,
        optimizer=optimizer,
        gathered_unit=unit * (GATHERED_UNIT_COPIES * setup.compute_bytes + setup.reduce_bytes),
        activations=tokens * activation_bytes_per_token(model, setup.gradient_checkpointing, setup.compute_bytes),
        logits=tokens * model.vocab * LOGIT_BYTES[setup.compute_bytes],
        expert_copies=tokens * layers * copies,
        router_probs=tokens * layers * router,
        sync_tensor=model.largest_tensor_params * setup.param_bytes,
        sync_buckets=TRAINER_BUCKETS * setup.bucket_bytes,
        resident_between_updates=(0.0 if setup.param_offload else parameters)
        + (0.0 if setup.optimizer_offload else optimizer),
        vision_activations=(
            setup.image_patches
            * vision_activation_bytes_per_patch(model.vision, setup.gradient_checkpointing, setup.compute_bytes)
            if model.vision is not None
            else 0.0
        ),
    )
