"""How long a GPU takes to decode, prefill and train, from the chip's datasheet and the model's shape.

Decoding is memory-bound: one decode step of an engine reads the weights once and the KV cache of every
running sequence, and does 2 FLOPs per matmul parameter per sequence; on top of that every layer costs a
fixed time per step that no byte or FLOP accounts for (kernel launches, scheduling, sampling), the same for
a small model as for a large one with as many layers. Training and prefill are compute-bound: 2 FLOPs per
parameter per token forward, plus causal attention. ``Efficiency`` turns datasheet peaks into achieved
speeds; docs/simulator.md says where every number comes from.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from areal_plugins.planning.vision import VisionShape


@dataclass(frozen=True)
class GPU:
    name: str
    memory_bandwidth: float  # bytes/s (HBM, datasheet)
    bf16_flops: float  # dense BF16 FLOP/s (datasheet)
    memory: float  # bytes


#: NVIDIA datasheets (SXM parts). The H800 is the H100 with less NVLink bandwidth: same HBM and FLOPs.
GPUS = {
    "h800": GPU("H800 SXM", 3.35e12, 989e12, 80e9),
    "h100": GPU("H100 SXM", 3.35e12, 989e12, 80e9),
    "h200": GPU("H200 SXM", 4.8e12, 989e12, 141e9),
    "a100": GPU("A100 SXM 80GB", 2.039e12, 312e12, 80e9),
}


@dataclass(frozen=True)
class ModelShape:
    """A decoder's shape as its Hugging Face ``config.json`` gives it (BF16 weights and KV cache).

    ``head_dim`` None: ``hidden // heads`` (config.json omits it where that holds). ``experts`` > 0: a mixture of
    experts whose every layer routes each token to ``experts_per_token`` of ``experts`` MLPs of
    ``moe_intermediate`` (Qwen3-MoE, Mixtral). ``max_positions``: ``max_position_embeddings``, None where unknown.
    ``qk_norm``: each attention head's q and k pass an RMSNorm of their own (``model_type`` qwen3, qwen3_moe).
    ``vision``: a vision-language model's vision tower (:mod:`areal_plugins.planning.vision`), whose parameters
    count in :attr:`params` (memory, weight loads, checkpoints) but not in a decode step's reads.
    """

    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    head_dim: int | None = None
    tied_embeddings: bool = False
    experts: int = 0
    experts_per_token: int = 0
    moe_intermediate: int = 0
    max_positions: int | None = None
    qk_norm: bool = False  # an RMSNorm over each attention head's q and k (Qwen3, Qwen3-MoE)
    vision: VisionShape | None = None  # a VLM's vision tower (config.json's vision_config)

    @property
    def head_size(self) -> int:
        return self.head_dim or self.hidden // self.heads

    @property
    def attention_params(self) -> int:
        """q, o (heads x head_size each way) and k, v (kv_heads x head_size); biases and norms left out."""
        return 2 * self.hidden * self.heads * self.head_size + 2 * self.hidden * self.kv_heads * self.head_size

    def _mlp_params(self, experts: int) -> int:
        if not self.experts:
            return 3 * self.hidden * self.intermediate  # gate, up, down
        return experts * 3 * self.hidden * self.moe_intermediate + self.hidden * self.experts  # + the router

    @property
    def layer_params(self) -> int:
        """Every weight of one decoder layer (all experts of a MoE)."""
        return self.attention_params + self._mlp_params(self.experts)

    @property
    def active_layer_params(self) -> int:
        """The weights of one layer a token multiplies through (a MoE's routed experts only)."""
        return self.attention_params + self._mlp_params(self.experts_per_token)

    @property
    def active_mlp_width(self) -> int:
        """The MLP width a token's activations span: ``intermediate``, or a MoE's routed experts' together."""
        return self.experts_per_token * self.moe_intermediate if self.experts else self.intermediate

    @property
    def decoder_params(self) -> int:
        """The language model's parameters: the layers, the input embedding and the output head (one matrix when
        tied)."""
        return self.layers * self.layer_params + self.vocab * self.hidden * (1 if self.tied_embeddings else 2)

    @property
    def vision_params(self) -> int:
        """The vision tower's parameters (0 for a text-only model)."""
        return self.vision.params if self.vision is not None else 0

    @property
    def params(self) -> int:
        """Every parameter: the language model's and a VLM's vision tower's."""
        return self.decoder_params + self.vision_params

    @property
    def matmul_params(self) -> int:
        """Parameters a token multiplies through: every layer and the output head (not the lookup)."""
        return self.layers * self.active_layer_params + self.vocab * self.hidden

    @property
    def weight_bytes(self) -> int:
        return 2 * self.params

    @property
    def largest_tensor_params(self) -> int:
        """The largest single parameter tensor: the embedding (vocab x hidden), or a MoE layer's fused
        gate-and-up experts (transformers 5 keeps them as one experts x 2·moe_intermediate x hidden tensor)."""
        return max(self.vocab * self.hidden, 2 * self.experts * self.moe_intermediate * self.hidden)

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_size * 2  # K and V, BF16

    def attention_flops(self, length: float) -> float:
        """Causal attention of one forward pass over ``length`` tokens: Q·Kᵀ and A·V, half the square."""
        return 2 * self.layers * self.heads * self.head_size * length * length


#: The paper's models (DeepSeek-R1-Distill-Qwen), shapes from their config.json files.
MODELS = {
    "1.5b": ModelShape("R1-Distill-Qwen-1.5B", 1536, 28, 12, 2, 8960, 151936),
    "7b": ModelShape("R1-Distill-Qwen-7B", 3584, 28, 28, 4, 18944, 152064),
    "14b": ModelShape("R1-Distill-Qwen-14B", 5120, 48, 40, 8, 13824, 152064),
    "32b": ModelShape("R1-Distill-Qwen-32B", 5120, 64, 40, 8, 27648, 152064),
}

#: Forward-pass equivalents per trained token: the proximal/old log-prob forward, the training forward,
#: the backward (2) and the activation recompute of gradient checkpointing (1).
TRAIN_PASSES = 5


@dataclass(frozen=True)
class Efficiency:
    """Achieved share of the datasheet peak (HBM bandwidth while decoding, FLOPs while training/prefilling)
    and the fixed seconds each layer adds to a decode step.

    The per-layer step latency is what separates a small model's decoding from a large one's: fitted as a
    share of bandwidth instead, the 1.5B's fixed costs would be charged per byte and grow 4.3x with the 7B's
    weights (docs/simulator.md, "What the 7B got wrong").
    """

    decode_bandwidth: float
    compute: float
    decode_step_latency: float = 0.0  # seconds per layer per decode step


@dataclass(frozen=True)
class DecodeCost:
    """Seconds of an inference engine's decode steps and prefills, from its byte and FLOP counts.

    One decode step of ``running`` sequences holding ``context`` tokens of KV cache reads the weights and that
    cache at ``bandwidth`` and does 2 FLOPs per matmul parameter per sequence at ``flops``, after a fixed
    ``step_latency`` (every layer's launches and scheduling). The cluster simulator (:class:`Engine`) and the
    bench's GPU-shaped engine stand-in (``tools/``, not in the package) both call these methods: the
    stand-in sleeps what the planner computes.
    """

    step_latency: float  # seconds per decode step, whatever the batch
    weight_bytes: float
    kv_bytes_per_token: float
    matmul_params: float  # parameters one token multiplies through
    attention_width: float  # layers x hidden: a prefill's attention FLOPs are 2 x this x Σ length²
    bandwidth: float  # bytes/s achieved
    flops: float  # FLOP/s achieved

    def step_s(self, running: int, context: float) -> float:
        """Seconds of one decode step with ``running`` sequences holding ``context`` tokens of KV cache."""
        memory = (self.weight_bytes + context * self.kv_bytes_per_token) / self.bandwidth
        return self.step_latency + memory + running * 2 * self.matmul_params / self.flops

    def growth_s(self, running: int) -> float:
        """How much each step slows the next: every running sequence adds one token of KV cache."""
        return running * self.kv_bytes_per_token / self.bandwidth

    def time_for_steps(self, running: int, context: float, steps: float) -> float:
        """Seconds for ``steps`` lockstep decode steps: the step time grows linearly with the cache."""
        return steps * self.step_s(running, context) + self.growth_s(running) * steps * steps / 2

    def steps_in(self, running: int, context: float, seconds: float) -> float:
        """The inverse of ``time_for_steps``: decode steps done in ``seconds`` (the positive root)."""
        a, c = self.step_s(running, context), self.growth_s(running)
        if c == 0:
            return seconds / a
        return (-a + (a * a + 2 * c * seconds) ** 0.5) / c

    def prefill_s(self, tokens: float, squared_tokens: float = 0.0) -> float:
        """Computing the KV cache of ``tokens`` (``squared_tokens`` = Σ length² for the attention part).

        Each sequence of length L costs 2·P·L FLOPs in its matmuls and, causally, Q·Kᵀ and A·V over L²/2
        (query, key) pairs, 2 x 2·hidden FLOPs each per layer: 2·layers·hidden·L² (Kaplan et al. 2020, Table 1,
        with the causal half). Sequences attend only to themselves, so a batch costs Σ L², never (Σ L)².
        """
        flops = 2 * self.matmul_params * tokens + 2 * self.attention_width * squared_tokens
        return flops / self.flops

    @staticmethod
    def kv_admits(running: int, reserved_tokens: float, request_tokens: float, capacity_tokens: float) -> bool:
        """Whether a request whose prompt + answer hold ``request_tokens`` of KV cache when done joins ``running``
        requests that reserve ``reserved_tokens`` of a cache of ``capacity_tokens`` (one request always runs).

        Bounded by tokens, not by a count of mean-length sequences: the requests running at any moment are
        length-biased (a request runs for as long as it is long), so their final lengths average E[L²]/E[L] —
        exp(σ²) = 6.2x the mean for the paper's log-normal, before the cap — and a count of cache / mean length
        overfills the cache several times over. The cluster simulator's engines and the bench's GPU-shaped
        stand-in both admit by this rule.
        """
        return running == 0 or reserved_tokens + request_tokens <= capacity_tokens


@dataclass(frozen=True)
class Engine:
    """One inference engine: ``tensor_parallel`` GPUs serving one model copy."""

    gpu: GPU
    model: ModelShape
    efficiency: Efficiency
    tensor_parallel: int = 1
    kv_memory_fraction: float = 0.7  # SGLang's mem_fraction_static in the paper's runs
    #: a KV cache of this many tokens instead of what the memory holds (a smaller engine: the bench's stand-in)
    kv_capacity_override: float | None = None

    @property
    def bandwidth(self) -> float:
        return self.gpu.memory_bandwidth * self.tensor_parallel * self.efficiency.decode_bandwidth

    @property
    def flops(self) -> float:
        return self.gpu.bf16_flops * self.tensor_parallel * self.efficiency.compute

    @property
    def kv_capacity_tokens(self) -> float:
        if self.kv_capacity_override is not None:
            return self.kv_capacity_override
        free = self.gpu.memory * self.tensor_parallel * self.kv_memory_fraction - self.model.weight_bytes
        if free <= 0:
            raise ValueError(
                f"{self.model.name} does not fit on {self.tensor_parallel} x {self.gpu.name}: "
                "use more tensor parallelism"
            )
        return free / self.model.kv_bytes_per_token

    @property
    def step_latency(self) -> float:
        """The fixed part of a decode step: every layer's launch and scheduling cost, whatever the batch."""
        return self.decode.step_latency

    @functools.cached_property
    def decode(self) -> DecodeCost:
        """This engine's decode and prefill times: the one function the simulator and the bench's stand-in call."""
        return DecodeCost(
            step_latency=self.model.layers * self.efficiency.decode_step_latency,
            weight_bytes=2 * self.model.decoder_params,  # a decode step reads the language model, not the ViT
            kv_bytes_per_token=self.model.kv_bytes_per_token,
            matmul_params=self.model.matmul_params,
            attention_width=self.model.layers * self.model.hidden,
            bandwidth=self.bandwidth,
            flops=self.flops,
        )

    def step_base(self, running: int, context: float) -> float:
        """Seconds of one decode step with ``running`` sequences holding ``context`` tokens of KV cache."""
        return self.decode.step_s(running, context)

    def step_growth(self, running: int) -> float:
        """How much each step slows the next: every running sequence adds one token of KV cache."""
        return self.decode.growth_s(running)

    def time_for_steps(self, running: int, context: float, steps: float) -> float:
        """Seconds for ``steps`` lockstep decode steps: the step time grows linearly with the cache."""
        return self.decode.time_for_steps(running, context, steps)

    def steps_in(self, running: int, context: float, seconds: float) -> float:
        """The inverse of ``time_for_steps``: decode steps done in ``seconds`` (the positive root)."""
        return self.decode.steps_in(running, context, seconds)

    def prefill_time(self, tokens: float, squared_tokens: float = 0.0) -> float:
        """Recomputing the KV cache of ``tokens`` (``squared_tokens`` = Σ length² for the attention part)."""
        return self.decode.prefill_s(tokens, squared_tokens)

    def weight_load_time(self) -> float:
        """New weights into the engine from host memory over PCIe Gen5 x16 (64 GB/s, datasheet)."""
        return self.model.weight_bytes / self.tensor_parallel / 64e9


def smallest_tensor_parallel(gpu: GPU, model: ModelShape, kv_memory_fraction: float = 0.7) -> int:
    """The fewest GPUs (a power of two) whose memory holds the weights with at least as much KV cache."""
    tp = 1
    while gpu.memory * tp * kv_memory_fraction < 2 * model.weight_bytes:
        tp *= 2
    return tp


def train_seconds(model: ModelShape, gpu: GPU, efficiency: Efficiency, devices: int, lengths: list[float]) -> float:
    """Seconds for one PPO step over sequences of ``lengths`` tokens (prompt + response) on ``devices``."""
    flops = sum(2 * model.matmul_params * n + model.attention_flops(n) for n in lengths) * TRAIN_PASSES
    return flops / (devices * gpu.bf16_flops * efficiency.compute)
