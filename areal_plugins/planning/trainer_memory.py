"""What one trainer GPU holds under verl's FSDP/FSDP2 engine: the sharded state, a micro-batch's transients, and a
weight sync's gathered tensor and buckets. Pure arithmetic (no verl, no torch); ``areal-plugins check`` reads the
numbers from the recipe (:mod:`areal_plugins.planning.cluster_fit`). docs/guides/sizing.md derives each term and
names its source.

Two phases peak apart, and the GPU must hold the larger:

- **update** (``actor.update_policy``): parameters, gradients and Adam's two moments, each sharded over the FSDP
  group, plus the FSDP unit gathered for compute, the micro-batch's activations and its logits;
- **weight sync** (after ``optimizer.step``, gradients freed): parameters and Adam, plus the full-size tensor
  verl's ``get_per_tensor_param`` gathers (``DTensor.full_tensor()``) and the checkpoint engine's buckets.
"""

from __future__ import annotations

from dataclasses import dataclass

from areal_plugins.planning.hardware import ModelShape

#: Bytes a token's activations take per decoder layer in bf16, measured: autograd's saved tensors of transformers'
#: Qwen2 decoder layer (sdpa attention, bf16) are 20·h + 8·I + 4·kv_heads·head_dim + 4·heads + 8 bytes a token, to
#: the byte (tests/unit/test_trainer_memory.py measures it with ``torch.autograd.graph.saved_tensors_hooks``):
#: the norms' inputs and their fp32 upcasts, q, the attention output and the residuals in h; the gated MLP's gate,
#: up, activation and product, 2 bytes x I each; k and v after the rotary embedding; the attention's fp32
#: log-sum-exp per head; the norms' fp32 scales. Korthikanti et al. 2022 (arXiv 2205.05198) §4.1 count 34·h for a
#: GPT layer of 4h MLP width (attention 11h, norms 4h, MLP 19h), the same order.
ACT_HIDDEN_FACTOR = 20
ACT_WIDTH_FACTOR = 8
ACT_KV_FACTOR = 4
ACT_HEAD_FACTOR = 4
ACT_LAYER_CONSTANT = 8
#: After the layers: the final norm and the output head's input, 8·h a token (measured as above).
ACT_FINAL_FACTOR = 8
#: With gradient checkpointing each layer keeps only its input (2·h bytes a token, bf16; measured), and the backward
#: recomputes one layer at a time: L·2·h + one layer's activations (Korthikanti et al. §5, full recompute).
CHECKPOINT_INPUT_BYTES = 2
#: The logits' bytes per token and vocabulary entry: the fp32 log-softmax of verl's
#: ``logprobs_from_logits_v2`` (flash-attention's cross-entropy, verl's other path, holds the bf16 logits and
#: writes their gradient in place: the same 2 + 2 bytes).
LOGIT_BYTES = 4
#: An FSDP unit gathered for compute: its parameters in bf16 twice (the unit computing and the one FSDP
#: prefetches) and its unsharded gradient in fp32 before the reduce-scatter (verl's ``reduce_dtype``).
GATHERED_UNIT_BYTES = 2 + 2 + 4
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


@dataclass(frozen=True)
class TrainerMemory:
    """Bytes on one trainer GPU, term by term."""

    parameters: float
    gradients: float
    optimizer: float
    gathered_unit: float
    activations: float
    logits: float
    sync_tensor: float
    sync_buckets: float
    resident_between_updates: float

    @property
    def state(self) -> float:
        return self.parameters + self.gradients + self.optimizer

    @property
    def update_peak(self) -> float:
        return self.state + self.gathered_unit + self.activations + self.logits

    @property
    def sync_peak(self) -> float:
        return self.parameters + self.optimizer + self.sync_tensor + self.sync_buckets

    @property
    def peak(self) -> float:
        return max(self.update_peak, self.sync_peak)


def layer_activation_bytes_per_token(model: ModelShape) -> int:
    """One decoder layer's saved activations for one token (bf16; see ``ACT_*``)."""
    return (
        ACT_HIDDEN_FACTOR * model.hidden
        + ACT_WIDTH_FACTOR * model.active_mlp_width
        + ACT_KV_FACTOR * model.kv_heads * model.head_size
        + ACT_HEAD_FACTOR * model.heads
        + ACT_LAYER_CONSTANT
    )


def activation_bytes_per_token(model: ModelShape, gradient_checkpointing: bool) -> int:
    """Activations one token leaves for the backward, over every layer and the head (bf16; see ``ACT_*``)."""
    one_layer = layer_activation_bytes_per_token(model)
    final = ACT_FINAL_FACTOR * model.hidden
    if gradient_checkpointing:
        return model.layers * CHECKPOINT_INPUT_BYTES * model.hidden + one_layer + final
    return model.layers * one_layer + final


def trainer_memory(model: ModelShape, setup: TrainerSetup) -> TrainerMemory:
    """Each term of a trainer GPU's memory (bytes); docs/guides/sizing.md gives the formulas."""
    shard = model.params / setup.shard_gpus
    on_gpu = 0.0 if setup.offload_policy else 1.0
    parameters = shard * setup.param_bytes * on_gpu
    gradients = shard * setup.param_bytes * on_gpu  # FSDP keeps gradients in the parameters' dtype
    optimizer = 2 * shard * setup.param_bytes * on_gpu  # torch AdamW: exp_avg, exp_avg_sq, like the parameter
    unit = max(model.layer_params, model.vocab * model.hidden)  # verl wraps each layer, embedding and head apart
    tokens = setup.micro_batch_tokens
    return TrainerMemory(
        parameters=parameters,
        gradients=gradients,
        optimizer=optimizer,
        gathered_unit=unit * GATHERED_UNIT_BYTES,
        activations=tokens * activation_bytes_per_token(model, setup.gradient_checkpointing),
        logits=tokens * model.vocab * LOGIT_BYTES,
        sync_tensor=model.largest_tensor_params * setup.param_bytes,
        sync_buckets=TRAINER_BUCKETS * setup.bucket_bytes,
        resident_between_updates=(0.0 if setup.param_offload else parameters)
        + (0.0 if setup.optimizer_offload else optimizer),
    )
