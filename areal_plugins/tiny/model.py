"""Build a tiny Qwen2 model (or a Qwen2-MoE: the ``moe`` workload) in Hugging Face format and warm-start it on the
addition task.

Hidden 128 x 2 layers with the 16,384-rank tokenizer (docs/design.md, The CPU box: larger models learned less in
the same wall time). Warm start measured here (greedy accuracy on 200 held-out problems, 2 cores):
70 steps 0.12, 150 steps 0.55 (45 s), 300 steps 0.73 (86 s); lr 3e-3 was worse (0.24 at 150 steps).
150 leaves GRPO both signal and room to improve.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from areal_plugins.tiny.supervised import warm_start
from areal_plugins.tiny.task import THINK_TOKEN, make_problems, thinking_lengths
from areal_plugins.tiny.tokenizer import write_tokenizer

#: Warm-start steps of the calculator task. Measured here (accuracy on 100 held-out sums, greedy / sampled):
#: 100 steps 0.09 greedy, 105 0.75, 130 0.87 / 0.32, 150 0.98 / 0.61; 130 leaves GRPO signal and room.
CALCULATOR_WARMSTART_STEPS = 130
#: Warm-start steps of the image task. Measured here (greedy accuracy on 200 held-out pictures, which the build
#: records as ``warmstart_greedy_accuracy`` in BUILT.json): 120 steps 0.30, 150 0.43 (30 s), 200 0.69; 150 leaves
#: GRPO signal and room.
VISION_WARMSTART_STEPS = 150


@dataclass(frozen=True)
class TinyModelSpec:
    """Shape and warm start of the tiny model."""

    tokenizer_ranks: int = 16384
    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 256
    warmstart_steps: int = 150
    warmstart_lr: float = 1e-3
    warmstart_batch: int = 32
    seed: int = 0
    #: Long-tail workload: answers come after a "thinking" run of " ." tokens whose length is lognormal
    #: (this median in tokens, 0: none), so sampled response lengths have a long tail as in reasoning RL.
    think_median: int = 0
    think_sigma: float = 1.0
    think_cap: int = 200
    #: addition: one-turn answers; calculator: two-digit sums through a calculator tool (tiny/calculator.py);
    #: vision: a digit in a picture plus one in the text, on a tiny Qwen2-VL (tiny/vision_model.py).
    task: str = "addition"
    #: Mixture of experts (a Qwen2-MoE, ``random_qwen2_moe``) when > 0: this many routed experts per MoE layer
    #: (every layer), ``experts_per_token`` of them chosen per token, each of ``moe_intermediate_size``, beside
    #: one shared expert of ``intermediate_size`` (Qwen2-MoE's layout). 0: the dense Qwen2.
    num_experts: int = 0
    experts_per_token: int = 2
    moe_intermediate_size: int = 64


#: The tiny workloads: short answers (recipes, tests), the benchmark's long-tailed responses, and
#: multi-turn episodes with a tool.
WORKLOADS = {
    "addition": TinyModelSpec(),
    "longtail": TinyModelSpec(think_median=8),
    "calculator": TinyModelSpec(task="calculator", warmstart_steps=CALCULATOR_WARMSTART_STEPS),
    # The addition task on a mixture of experts: 4 routed experts, 2 per token, and the shared expert; the routed
    # experts together are as wide as the dense model's MLP (4 x 64 = 256), so a token computes 2 x 64 + 256.
    # Measured here after the same 150-step warm start: greedy accuracy on 200 held-out sums 0.48 (the dense
    # model: 0.545 in the same measurement), so GRPO has signal and room.
    "moe": TinyModelSpec(num_experts=4, experts_per_token=2, moe_intermediate_size=64),
    # A Qwen2-VL of the dense model's text shape with a one-block vision tower: count the squares in a picture, add.
    "vision": TinyModelSpec(task="vision", warmstart_steps=VISION_WARMSTART_STEPS),
    # The trainer's side of the paced-engine bench: a model so small that a step's training costs little next to
    # the control plane (512 tokenizer ranks fit the prompts in 22 tokens; ~20k weights; untrained).
    "paced": TinyModelSpec(
        tokenizer_ranks=512,
        hidden_size=32,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        intermediate_size=64,
        warmstart_steps=0,
    ),
}


def random_qwen2(spec: TinyModelSpec, vocab_size: int, **config_overrides: Any) -> Any:
    """A randomly initialised ``Qwen2ForCausalLM`` of ``spec``'s shape (seeded by ``spec.seed``), in float32."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(spec.seed)
    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        dtype="float32",
        **config_overrides,
    )
    return Qwen2ForCausalLM(config)


def random_qwen2_moe(spec: TinyModelSpec, vocab_size: int, **config_overrides: Any) -> Any:
    """A randomly initialised ``Qwen2MoeForCausalLM`` of ``spec``'s shape (seeded by ``spec.seed``), in float32:
    ``spec.num_experts`` routed experts in every layer, ``spec.experts_per_token`` per token, and a shared expert."""
    import torch
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    if spec.num_experts < spec.experts_per_token or spec.experts_per_token < 1:
        raise ValueError(
            f"a mixture of experts needs 1 <= experts_per_token <= num_experts, got {spec.experts_per_token} of "
            f"{spec.num_experts}"
        )
    torch.manual_seed(spec.seed)
    config = Qwen2MoeConfig(
        vocab_size=vocab_size,
        hidden_size=spec.hidden_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        num_experts=spec.num_experts,
        num_experts_per_tok=spec.experts_per_token,
        moe_intermediate_size=spec.moe_intermediate_size,
        shared_expert_intermediate_size=spec.intermediate_size,
        intermediate_size=spec.intermediate_size,
        decoder_sparse_step=1,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        dtype="float32",
        **config_overrides,
    )
    return Qwen2MoeForCausalLM(config)


def random_model(spec: TinyModelSpec, vocab_size: int, **config_overrides: Any) -> Any:
    """The dense Qwen2 or, with ``spec.num_experts``, the Qwen2-MoE of ``spec``."""
    build = random_qwen2_moe if spec.num_experts else random_qwen2
    return build(spec, vocab_size, **config_overrides)


def build_tiny_model(out_dir: Path, spec: TinyModelSpec) -> dict[str, float]:
    """Write tokenizer, config and weights to ``out_dir``; return warm-start metrics."""
    from transformers import AutoTokenizer

    if spec.task == "vision":
        from areal_plugins.tiny.vision_model import build_tiny_vlm

        return build_tiny_vlm(out_dir, spec)

    n_tokens = write_tokenizer(out_dir, spec.tokenizer_ranks)
    tokenizer = AutoTokenizer.from_pretrained(out_dir)
    model = random_model(
        spec,
        vocab_size=(n_tokens + 63) // 64 * 64,
        bos_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    if spec.warmstart_steps <= 0:
        metrics: dict[str, float] = {}
    elif spec.task == "calculator":
        from areal_plugins.tiny import calculator

        metrics = calculator.warm_start(
            model, tokenizer, spec.warmstart_steps, spec.warmstart_batch, spec.warmstart_lr, spec.seed
        )
    else:
        metrics = _warm_start(model, tokenizer, spec)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out_dir, safe_serialization=True)
    return metrics


def _warm_start(model, tokenizer, spec: TinyModelSpec) -> dict[str, float]:
    """Supervised steps on ``prompt -> answer<|im_end|>`` with the loss on the answer only."""
    # Seed offset keeps warm-start problems apart from the RL data's default seeds.
    problems = make_problems(spec.warmstart_steps * spec.warmstart_batch, seed=spec.seed + 10_000)
    think = thinking_lengths(len(problems), spec.think_median, spec.think_sigma, spec.think_cap, spec.seed + 20_000)
    filler = tokenizer.encode(THINK_TOKEN, add_special_tokens=False)

    def example(problem, think_tokens: int) -> tuple[list[int], list[int]]:
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": problem.question}], add_generation_prompt=True, tokenize=False
        )
        prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
        answer_text = (" " if think_tokens else "") + problem.answer
        answer_ids = [
            *filler * think_tokens,
            *tokenizer.encode(answer_text, add_special_tokens=False),
            tokenizer.eos_token_id,
        ]
        return prompt_ids + answer_ids, [-100] * len(prompt_ids) + answer_ids

    size = spec.warmstart_batch
    batches = (
        [example(p, t) for p, t in zip(problems[k * size : (k + 1) * size], think[k * size :], strict=False)]
        for k in range(spec.warmstart_steps)
    )
    return warm_start(model, batches, spec.warmstart_steps, spec.warmstart_lr, tokenizer.pad_token_id, spec.task)
