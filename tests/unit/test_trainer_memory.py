"""A trainer GPU's memory under verl's FSDP, term by term against hand counts (docs/guides/sizing.md derives each)."""

from __future__ import annotations

import pytest

from areal_plugins.planning.hardware import ModelShape
from areal_plugins.planning.model_shapes import from_table
from areal_plugins.planning.trainer_memory import (
    TrainerSetup,
    activation_bytes_per_token,
    layer_activation_bytes_per_token,
    lora_adapter_params,
    trainer_memory,
)

GIB = 1024**3
#: Qwen2.5-7B: 7,615,283,200 parameters (tests/unit/test_model_shapes.py counts them by hand); a layer is
#: 29,360,128 (attention) + 203,685,888 (MLP) = 233,046,016, the embedding (and the untied head) 152,064 x 3584 =
#: 544,997,376.
QWEN7B = from_table("Qwen/Qwen2.5-7B").shape
P7B = 7_615_283_200
#: The GPU recipes' micro-batch: areal.micro_batch.max_tokens = ppo_max_token_len_per_gpu = 24,576 tokens.
TOKENS = 24_576


def setup(gpus: int, **changes) -> TrainerSetup:
    fields = dict(shard_gpus=gpus, param_bytes=4, micro_batch_tokens=TOKENS, gradient_checkpointing=True,
                  bucket_bytes=2048 << 20)  # fmt: skip
    return TrainerSetup(**(fields | changes))


def test_fp32_state_is_16_bytes_a_parameter_sharded_over_the_group():
    """fp32 parameters 4 + gradients 4 + Adam's exp_avg 4 and exp_avg_sq 4 = 16 bytes a parameter, over 2 GPUs:
    8 x 7,615,283,200 = 60,922,265,600 bytes = 56.7 GiB a GPU (the issue's "61 GB a GPU of fp32 state")."""
    memory = trainer_memory(QWEN7B, setup(2))
    assert (memory.parameters, memory.gradients, memory.optimizer) == (2 * P7B, 2 * P7B, 4 * P7B)
    assert memory.state == 60_922_265_600
    assert trainer_memory(QWEN7B, setup(8)).state == 2 * P7B  # 15,230,566,400: a quarter on 8 GPUs
    assert trainer_memory(QWEN7B, setup(2, param_bytes=2)).state == 4 * P7B  # bf16 weights: 8 bytes a parameter


#: Qwen2.5-7B's rank-64 adapter on every linear layer, by hand: per layer rank x (in + out) of q 3584+3584, k and v
#: 3584+512 (4 KV heads of 128), o 3584+3584, gate and up 3584+18944, down 18944+3584 = 64 x 90,112 = 5,767,168;
#: 28 layers: 161,480,704 (0.32 GB in bf16, the issue's "~0.3 GB for a rank-64 adapter").
LORA64_7B = 161_480_704


def test_lora_trains_the_adapter_alone_so_gradients_and_adam_are_the_adapters():
    assert lora_adapter_params(QWEN7B, 64) == LORA64_7B
    assert lora_adapter_params(QWEN7B, 64, ["q_proj", "v_proj"]) == 28 * 64 * (7168 + 4096)
    with pytest.raises(ValueError, match="target_modules names \\['lm_head'\\]"):
        lora_adapter_params(QWEN7B, 64, ["q_proj", "lm_head"])
    full, lora = trainer_memory(QWEN7B, setup(8)), trainer_memory(QWEN7B, setup(8, lora_params=LORA64_7B))
    # fp32 over 8 GPUs: the frozen base and the adapter held, the adapter's gradient and two Adam moments.
    assert lora.parameters == (P7B + LORA64_7B) / 8 * 4
    assert (lora.gradients, lora.optimizer) == (LORA64_7B / 8 * 4, 2 * LORA64_7B / 8 * 4)
    assert full.state - lora.state == pytest.approx((3 * P7B - 3 * LORA64_7B - LORA64_7B) / 8 * 4)
    assert lora.state / GIB == pytest.approx(3.85, abs=0.01)  # against 14.2 GiB of full fine-tuning's state


def test_check_counts_the_recipes_adapter():
    """``check``'s trainer memory reads the recipe's ``lora_rank`` and ``target_modules`` (cluster_fit)."""
    from omegaconf import OmegaConf

    from areal_plugins.planning.cluster_fit import _lora_params

    def recipe(**model):
        return OmegaConf.create({"actor_rollout_ref": {"model": model}})

    assert _lora_params(recipe(lora_rank=0), QWEN7B) == 0
    assert _lora_params(recipe(lora_rank=64, target_modules="all-linear"), QWEN7B) == LORA64_7B
    assert _lora_params(recipe(lora={"rank": 64}), QWEN7B) == LORA64_7B  # verl's other spelling


def test_the_micro_batchs_transients():
    """Logits: 24,576 tokens x 152,064 x 4 bytes = 14,948,499,456 (13.9 GiB). A layer's activations a token:
    20 x 3584 + 8 x 18,944 + 4 x 4 x 128 + 4 x 28 + 8 = 71,680 + 151,552 + 2,048 + 112 + 8 = 225,400; the final
    norm and head 8 x 3584 = 28,672. With gradient checkpointing: 28 layer inputs x 2 x 3584 = 200,704 + one layer
    recomputed 225,400 + 28,672 = 454,776 bytes x 24,576 = 11,176,574,976 (10.4 GiB). Without: 28 x 225,400 +
    28,672 = 6,339,872 bytes a token. The gathered FSDP unit: the embedding, larger than a layer, 544,997,376 x
    (2 + 2 + 4) = 4,359,979,008."""
    memory = trainer_memory(QWEN7B, setup(2))
    assert memory.logits == 14_948_499_456
    assert memory.activations == 11_176_574_976
    assert activation_bytes_per_token(QWEN7B, gradient_checkpointing=False) == 6_339_872
    assert memory.gathered_unit == 4_359_979_008


def test_7b_on_two_80gb_trainer_gpus_overflows_and_on_eight_fits():
    """Update peak on 2 GPUs: 60,922,265,600 + 4,359,979,008 + 11,176,574,976 + 14,948,499,456 = 91,407,319,040
    bytes = 85.1 GiB, over an H100's 79.6 before any CUDA context. On 8: 15,230,566,400 + the same 30,485,053,440
    of transients = 45,715,619,840 = 42.6 GiB."""
    assert trainer_memory(QWEN7B, setup(2)).update_peak == 91_407_319_040
    assert trainer_memory(QWEN7B, setup(8)).update_peak == 45_715_619_840
    assert trainer_memory(QWEN7B, setup(8)).peak / GIB == pytest.approx(42.58, abs=0.01)


def test_the_weight_sync_holds_parameters_adam_the_gathered_tensor_and_two_buckets():
    """Gradients are freed by then: 12 x 7,615,283,200 / 2 = 45,691,699,200, + the fp32 embedding gathered whole
    544,997,376 x 4 = 2,179,989,504, + 2 buckets of 2 GiB = 4,294,967,296: 52,166,656,000."""
    memory = trainer_memory(QWEN7B, setup(2))
    assert memory.sync_tensor == 2_179_989_504 and memory.sync_buckets == 4_294_967_296
    assert memory.sync_peak == 52_166_656_000
    assert trainer_memory(QWEN7B, setup(2, bucket_bytes=0)).sync_buckets == 0  # naive: no buckets


def test_offload_keys():
    """FSDP2's offload_policy keeps the state on the CPU while training; param_offload and optimizer_offload
    move it there only between phases (verl loads it back to train), so they lower what stays beside an awake
    colocated engine, not the update's peak."""
    offloaded = trainer_memory(QWEN7B, setup(2, offload_policy=True))
    assert offloaded.state == 0 and offloaded.update_peak == 91_407_319_040 - 60_922_265_600
    assert offloaded.sync_tensor == 2_179_989_504  # gathered onto the GPU all the same
    kept = trainer_memory(QWEN7B, setup(2, param_offload=True, optimizer_offload=True))
    assert kept.update_peak == 91_407_319_040 and kept.resident_between_updates == 0
    assert trainer_memory(QWEN7B, setup(2, optimizer_offload=True)).resident_between_updates == 2 * P7B


def test_a_moe_gathers_its_layer_and_routes_a_tokens_activations_through_k_experts():
    """Qwen3-30B-A3B: a layer's 128 experts (3 x 2048 x 768 each) + attention + router = 623,116,288 parameters,
    larger than the embedding (151,936 x 2048 = 311,164,928): the gathered unit is the layer. A token's MLP
    activations span its 8 experts' 8 x 768 = 6144 width. A layer, bf16: 2 x (4 x 2048 + 2 x 32 x 128 (q and the
    attention output, 4096 wide) + 4 x 6144 + 2 x 4 x 128 + (32 + 4) x 128 (the q/k norms' inputs)) + 4 x (2 x 2048
    + 32) + 4 x (32 + 4) x 129 (the q/k norms' fp32 upcasts and scales) + 8 = 93,184 + 16,512 + 18,576 + 8 = 128,280;
    the largest tensor the sync gathers is the fused gate-and-up experts, 128 x 1536 x 2048 = 402,653,184."""
    moe = from_table("Qwen/Qwen3-30B-A3B").shape
    assert moe.layer_params == 18_874_368 + 128 * 3 * 2048 * 768 + 2048 * 128 == 623_116_288
    memory = trainer_memory(moe, setup(8))
    assert memory.gathered_unit == 623_116_288 * 8
    assert moe.qk_norm and not QWEN7B.qk_norm
    assert activation_bytes_per_token(moe, gradient_checkpointing=False) == 48 * 128_280 + 8 * 2048
    assert memory.sync_tensor == 402_653_184 * 4


def test_a_toy_model_by_hand():
    toy = ModelShape("toy", hidden=4, layers=2, heads=2, kv_heads=1, intermediate=8, vocab=10)
    # a layer: q, o 2·4·4 = 32; k, v 2·4·1·2 = 16; MLP 3·4·8 = 96 -> 144; 2 layers 288 + embedding and head 80
    assert toy.params == 368
    memory = trainer_memory(toy, TrainerSetup(shard_gpus=1, param_bytes=4, micro_batch_tokens=3,
                                              gradient_checkpointing=False))  # fmt: skip
    # state 16 x 368; unit max(144, 40) x 8; activations 3 x (2 x (20·4 + 8·8 + 4·1·2 + 4·2 + 8) + 8·4) = 3 x 368;
    # logits 3 x 10 x 4
    assert (memory.state, memory.gathered_unit, memory.activations, memory.logits) == (5888, 1152, 1104, 120)


def saved_activation_bytes(
    hidden: int, width: int, layers: int, heads: int, kv_heads: int, dtype: str = "bfloat16", tokens: int = 256
) -> int:
    """What transformers' Qwen2 in ``dtype`` (sdpa attention) saves for its backward on a forward of ``tokens``
    tokens, counted by autograd's saved-tensor hooks (each storage once, parameters left out)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(hidden_size=hidden, intermediate_size=width, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, vocab_size=1000,
                         max_position_embeddings=4096, tie_word_embeddings=False, use_cache=False)  # fmt: skip
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).to(getattr(torch, dtype)).train()
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in weights:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(input_ids=torch.randint(0, 1000, (1, tokens)))
    return sum(saved.values())


@pytest.mark.parametrize(("dtype", "compute_bytes"), [("bfloat16", 2), ("float32", 4)])
@pytest.mark.parametrize(
    ("hidden", "width", "heads", "kv_heads"), [(256, 768, 4, 2), (512, 768, 8, 2), (256, 1536, 4, 4)]
)
def test_the_layer_formula_is_what_transformers_saves(hidden, width, heads, kv_heads, dtype, compute_bytes):
    """The per-layer term to the byte, in bf16 and in fp32 compute: the difference between 4 and 2 layers of a real
    Qwen2, halved. The whole model (the embedding's and the head's side included) within 2%."""
    shape = ModelShape("m", hidden=hidden, layers=4, heads=heads, kv_heads=kv_heads, intermediate=width, vocab=1000)
    two, four = (saved_activation_bytes(hidden, width, n, heads, kv_heads, dtype) for n in (2, 4))
    assert (four - two) / 2 / 256 == layer_activation_bytes_per_token(shape, compute_bytes)
    whole = activation_bytes_per_token(shape, gradient_checkpointing=False, compute_bytes=compute_bytes)
    assert four / 256 == pytest.approx(whole, rel=0.02)


def test_fp32_compute_by_hand():
    """mixed_precision.param_dtype=fp32 (the CPU recipes' setting) on Qwen2.5-7B over 8 GPUs. A layer's activations a
    token: 4 x (6 x 3584 + 4 x 18,944 + 2 x 4 x 128) + 4 x (2 x 3584 + 28) + 8 = 4 x 98,304 + 28,784 + 8 = 422,008
    (bf16: 225,400); the final norm and head (2 x 4 + 4) x 3584 = 43,008. With gradient checkpointing: 28 layer
    inputs x 4 x 3584 = 401,408 + 422,008 + 43,008 = 866,424 bytes x 24,576 tokens = 21,293,236,224; without: 28 x
    422,008 + 43,008 = 11,859,232 a token. Logits: 24,576 x 152,064 x 12 = 44,845,498,368 (three times bf16's 4).
    The gathered unit: the embedding 544,997,376 x (4 + 4 + 4) = 6,539,968,512. The state is the parameters'
    (model_dtype), not the compute dtype's: unchanged."""
    bf16, fp32 = trainer_memory(QWEN7B, setup(8)), trainer_memory(QWEN7B, setup(8, compute_bytes=4))
    assert layer_activation_bytes_per_token(QWEN7B, compute_bytes=4) == 422_008
    assert fp32.activations == 21_293_236_224
    assert activation_bytes_per_token(QWEN7B, gradient_checkpointing=False, compute_bytes=4) == 11_859_232
    assert fp32.logits == 44_845_498_368 == 3 * bf16.logits
    assert fp32.gathered_unit == 6_539_968_512
    assert fp32.state == bf16.state == 2 * P7B
    # bf16 reduce (mixed_precision.reduce_dtype=bf16): the unsharded gradient in 2 bytes, 544,997,376 x 6
    assert trainer_memory(QWEN7B, setup(8, reduce_bytes=2)).gathered_unit == 3_269_984_256
    with pytest.raises(ValueError, match="compute_bytes=8"):
        setup(8, compute_bytes=8)


#: Qwen3-30B-A3B's published config.json (https://huggingface.co/Qwen/Qwen3-30B-A3B/blob/main/config.json), the keys
#: the sizing reads.
QWEN3_30B_A3B = {
    "model_type": "qwen3_moe", "hidden_size": 2048, "num_hidden_layers": 48, "num_attention_heads": 32,
    "num_key_value_heads": 4, "head_dim": 128, "intermediate_size": 6144, "moe_intermediate_size": 768,
    "num_experts": 128, "num_experts_per_tok": 8, "vocab_size": 151936, "max_position_embeddings": 40960,
    "tie_word_embeddings": False,
}  # fmt: skip


def test_qwen3_30b_a3b_on_eight_gpus_counts_the_expert_copies_and_the_router():
    """Issue 59: 8 trainer GPUs, a 17,408-token micro-batch (a 16k answer and its prompt), gradient checkpointing.
    Parameters: 48 x (attention 18,874,368 + experts 128 x 3 x 2048 x 768 = 603,979,776 + router 2048 x 128 =
    262,144) + 2 x 151,936 x 2048 = 30,531,911,680; fp32 state 16 B / 8 GPUs = 61,063,823,360. Unit 623,116,288 x 8 =
    4,984,930,304. Logits 17,408 x 151,936 x 4 = 10,579,607,552. Activations (48 x 2 x 2048 + 128,280 (a layer, above)
    + 8 x 2048 = 341,272 a token) x 17,408 = 5,940,862,976; the issue's 76.3 GiB counted 305,288 a token (q and the
    attention output as 2048 wide, no q/k norms). The recomputed layer's dispatch + combine copies: 2 x 8 x 2048 x 2
    = 65,536 B a token x 17,408 = 1,140,850,688 (1.06 GiB); its fp32 router probabilities 128 x 4 = 512 B a token x
    17,408 = 8,912,896. Update peak 83,718,987,776 = 78.0 GiB."""
    from areal_plugins.planning.model_shapes import shape_from_config
    from areal_plugins.planning.trainer_memory import moe_bytes_per_token

    moe = shape_from_config(QWEN3_30B_A3B, "Qwen/Qwen3-30B-A3B")
    assert moe_bytes_per_token(moe) == (65_536, 512)
    memory = trainer_memory(moe, setup(8, micro_batch_tokens=17_408))
    assert memory.state == 61_063_823_360
    assert memory.expert_copies == 1_140_850_688 and memory.router_probs == 8_912_896
    assert memory.activations == 5_940_862_976
    assert memory.update_peak == 83_718_987_776
    # without gradient checkpointing every one of the 48 layers keeps both
    plain = trainer_memory(moe, setup(8, micro_batch_tokens=17_408, gradient_checkpointing=False))
    assert plain.expert_copies == 48 * 1_140_850_688 and plain.router_probs == 48 * 8_912_896
    # a dense model has neither
    assert trainer_memory(QWEN7B, setup(8)).expert_copies == trainer_memory(QWEN7B, setup(8)).router_probs == 0


def saved_moe_layer_bytes(top_k: int, experts: int, hidden: int = 256, width: int = 128, tokens: int = 256) -> float:
    """A token's saved bytes per decoder layer of transformers' Qwen3-MoE in bf16 (its default ``grouped_mm`` experts),
    by autograd's saved-tensor hooks: the difference between 4 and 2 layers, halved."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    def saved(layers: int) -> int:
        config = Qwen3MoeConfig(hidden_size=hidden, intermediate_size=512, moe_intermediate_size=width,
                                num_experts=experts, num_experts_per_tok=top_k, num_hidden_layers=layers,
                                num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=1000,
                                max_position_embeddings=4096, use_cache=False, mlp_only_layers=[])  # fmt: skip
        config._attn_implementation = "sdpa"
        torch.manual_seed(0)
        model = Qwen3MoeForCausalLM._from_config(config, experts_implementation="grouped_mm").to(torch.bfloat16)
        weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
        kept: dict[int, int] = {}

        def pack(tensor):
            if tensor.untyped_storage().data_ptr() not in weights:
                kept[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            model.train()(input_ids=torch.randint(0, 1000, (1, tokens)))
        return sum(kept.values())

    return (saved(4) - saved(2)) / 2 / tokens


def test_the_moe_terms_are_what_transformers_saves():
    """Two more routed experts a token (top-2 -> top-4) add, a layer, their dispatch and combine copies (2 x h x 2 B)
    and their gate, up, activation and product (4 x moe_intermediate x 2 B), + ~39 bytes of routing indices each
    (not counted); 16 more experts add 16 fp32 router probabilities (64 B), + a fraction of a byte of per-layer
    bookkeeping spread over the tokens."""
    from areal_plugins.planning.trainer_memory import moe_bytes_per_token

    shape = ModelShape("m", hidden=256, layers=4, heads=4, kv_heads=2, intermediate=512, vocab=1000, head_dim=64,
                       experts=16, experts_per_token=4, moe_intermediate=128)  # fmt: skip
    copies_per_expert = moe_bytes_per_token(shape)[0] // 4
    assert copies_per_expert == 2 * 256 * 2
    grown_k = saved_moe_layer_bytes(4, 16) - saved_moe_layer_bytes(2, 16)
    counted = 2 * (copies_per_expert + 4 * 128 * 2)
    assert counted <= grown_k <= counted + 2 * 48, grown_k
    grown_experts = saved_moe_layer_bytes(4, 32) - saved_moe_layer_bytes(4, 16)
    assert grown_experts == pytest.approx(16 * 4, abs=1)
    assert moe_bytes_per_token(shape)[1] == 16 * 4


def saved_qwen3_layer_bytes(hidden: int, heads: int, kv_heads: int, dtype: str) -> float:
    """A token's saved bytes per decoder layer of transformers' Qwen3 (head_dim 64, sdpa): 4 layers less 2, halved."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    def saved(layers: int) -> int:
        config = Qwen3Config(hidden_size=hidden, intermediate_size=768, num_hidden_layers=layers,
                             num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=64, vocab_size=1000,
                             max_position_embeddings=4096, use_cache=False, tie_word_embeddings=False)  # fmt: skip
        config._attn_implementation = "sdpa"
        torch.manual_seed(0)
        model = Qwen3ForCausalLM(config).to(getattr(torch, dtype)).train()
        weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
        kept: dict[int, int] = {}

        def pack(tensor):
            if tensor.untyped_storage().data_ptr() not in weights:
                kept[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            model(input_ids=torch.randint(0, 1000, (1, 256)))
        return sum(kept.values())

    return (saved(4) - saved(2)) / 2 / 256


@pytest.mark.parametrize(("dtype", "compute_bytes"), [("bfloat16", 2), ("float32", 4)])
@pytest.mark.parametrize(("hidden", "heads", "kv_heads"), [(256, 4, 2), (256, 8, 2)])
def test_the_layer_formula_holds_for_qwen3s_qk_norms_and_wide_heads(hidden, heads, kv_heads, dtype, compute_bytes):
    """Qwen3 normalises each head's q and k, and its heads x head_dim need not be h (8 x 64 = 512 over h = 256, as
    Qwen3-30B-A3B's 32 x 128 = 4096 over 2048): the layer's saved bytes to the byte, both dtypes."""
    shape = ModelShape("m", hidden=hidden, layers=4, heads=heads, kv_heads=kv_heads, intermediate=768, vocab=1000,
                       head_dim=64, qk_norm=True)  # fmt: skip
    assert saved_qwen3_layer_bytes(hidden, heads, kv_heads, dtype) == layer_activation_bytes_per_token(
        shape, compute_bytes
    )
