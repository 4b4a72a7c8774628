"""The tiny mixture of experts (tiny/model.py's ``moe`` workload) on our CPU engine (rollout/cpu/).

References are independent of the engine: transformers' own greedy ``generate`` for the tokens, and for the routed
experts the indices the model's routers (``Qwen2MoeTopKRouter``) chose in one plain forward pass over the prompt
and the generated tokens, read by forward hooks. The shape of ``routed_experts`` is vLLM's (verl 0.9.1's vLLM server
passes ``CompletionOutput.routed_experts`` on, ``[seq_len, layer_num, topk]``): one row per token fed through the
model, so a prompt of P tokens and N generated ones give P + N - 1 rows (the last token is sampled, never fed).
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import json

import numpy as np
import pytest
import torch

from areal_plugins.rollout.cpu.engine import ContinuousBatchingEngine
from areal_plugins.tiny.model import WORKLOADS, build_tiny_model
from areal_plugins.tiny.task import make_problems
from areal_plugins.weight_sync.errors import WeightSyncError

LAYERS, EXPERTS, TOP_K = 2, 4, 2
EXPERT_TENSOR = "model.layers.1.mlp.experts.down_proj"  # every expert's down projection of layer 1, stacked


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    """The ``moe`` workload as the builder writes it (real tokenizer, HF format), without the warm start, and with
    its weights redrawn wider than the initialiser's (std 0.3, seeded): at std 0.02 an untrained model repeats one
    token and routes every token alike, which would make the comparisons below trivial."""
    from transformers import AutoModelForCausalLM

    out = tmp_path_factory.mktemp("tiny_moe")
    build_tiny_model(out, dataclasses.replace(WORKLOADS["moe"], warmstart_steps=0))
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() >= 2:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.3)
    model.save_pretrained(out, safe_serialization=True)
    return out


@pytest.fixture(scope="module")
def prompts(moe_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(moe_dir)
    chats = [[{"role": "user", "content": problem.question}] for problem in make_problems(3, seed=7)]
    prompts = [tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False) for chat in chats]
    encoded = [tokenizer.encode(prompt, add_special_tokens=False) for prompt in prompts]
    encoded[1] = encoded[1][:-3]  # prompts of different lengths: the batched decode left-pads their caches
    return encoded


def reference_model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()


def server(path, **kwargs):
    from areal_plugins.rollout.cpu.server import CPURolloutServer

    return CPURolloutServer(str(path), response_length=12, max_model_len=64, **kwargs)


def routers_choice(model, token_ids: list[int]) -> np.ndarray:
    """The experts each router chose for every position of one forward pass: (tokens, layers, top-k)."""
    chosen: list[torch.Tensor] = []
    hooks = [
        layer.mlp.gate.register_forward_hook(lambda module, inputs, output: chosen.append(output[2]))
        for layer in model.model.layers
    ]
    try:
        with torch.no_grad():
            model(input_ids=torch.tensor([token_ids]))
    finally:
        for hook in hooks:
            hook.remove()
    return torch.stack(chosen, dim=1).numpy()


def test_the_builder_writes_a_qwen2_moe_with_the_tiny_tokenizer(moe_dir):
    from transformers import AutoTokenizer

    config = json.loads((moe_dir / "config.json").read_text())
    assert config["architectures"] == ["Qwen2MoeForCausalLM"]
    assert (config["num_experts"], config["num_experts_per_tok"], config["num_hidden_layers"]) == (
        EXPERTS,
        TOP_K,
        LAYERS,
    )
    tokenizer = AutoTokenizer.from_pretrained(moe_dir)
    assert json.loads((moe_dir / "generation_config.json").read_text())["eos_token_id"] == tokenizer.eos_token_id
    assert config["vocab_size"] >= len(tokenizer)


def test_our_engine_generates_what_transformers_generates_greedily(moe_dir, prompts):
    engine_server = server(moe_dir)
    reference = reference_model(moe_dir)

    async def generate_together():
        return await asyncio.gather(
            *(engine_server.engine.generate(p, max_tokens=10, temperature=0.0, ignore_eos=True) for p in prompts)
        )

    results = asyncio.run(generate_together())
    reference.generation_config.eos_token_id = None  # as ignore_eos: ten tokens each
    for prompt, result in zip(prompts, results, strict=True):
        expected = reference.generate(
            torch.tensor([prompt]), max_new_tokens=10, do_sample=False, pad_token_id=0, attention_mask=None
        )[0, len(prompt) :].tolist()
        assert result.token_ids == expected
    assert len({token for result in results for token in result.token_ids}) > 3, "a degenerate model proves little"


def test_routed_experts_are_the_routers_choice_in_a_plain_forward_pass(moe_dir, prompts):
    engine_server = server(moe_dir, routed_experts=True)
    reference = reference_model(moe_dir)

    async def generate_together():
        return await asyncio.gather(
            *(engine_server.engine.generate(p, max_tokens=6, temperature=0.8, ignore_eos=True) for p in prompts)
        )

    results = asyncio.run(generate_together())
    for prompt, result in zip(prompts, results, strict=True):
        routed = result.routed_experts
        assert routed.shape == (len(prompt) + 6 - 1, LAYERS, TOP_K)
        assert routed.dtype == np.int32
        np.testing.assert_array_equal(routed, routers_choice(reference, prompt + result.token_ids[:-1]))
    all_rows = np.concatenate([result.routed_experts for result in results])
    assert len({tuple(row) for row in all_rows.reshape(-1, TOP_K).tolist()}) > 1, "every token routed alike"


def test_the_server_returns_routed_experts_in_verls_field_only_when_asked(moe_dir, prompts):
    params = {"temperature": 0.0, "logprobs": True, "max_tokens": 4, "ignore_eos": True}
    with_replay = asyncio.run(server(moe_dir, routed_experts=True).generate(prompts[0], dict(params), "r1"))
    assert with_replay.routed_experts.shape == (len(prompts[0]) + 3, LAYERS, TOP_K)
    without = asyncio.run(server(moe_dir).generate(prompts[0], dict(params), "r2"))
    assert without.routed_experts is None
    assert without.token_ids == with_replay.token_ids


def test_an_aborted_request_keeps_a_row_for_every_token_it_fed(moe_dir, prompts):
    engine_server = server(moe_dir, routed_experts=True)
    engine = engine_server.engine

    async def generate_then_abort():
        request = asyncio.ensure_future(engine.generate(prompts[0], max_tokens=40, temperature=0.0, ignore_eos=True))
        while not engine._running or not engine._running[0].token_ids:
            await asyncio.sleep(0.001)
        engine.abort_all()
        return await request

    result = asyncio.run(generate_then_abort())
    assert result.stop_reason == "aborted" and 1 <= len(result.token_ids) < 40
    assert result.routed_experts.shape == (len(prompts[0]) + len(result.token_ids) - 1, LAYERS, TOP_K)


def test_routed_experts_of_a_dense_model_are_refused_naming_the_setting(random_qwen2):
    with pytest.raises(ValueError, match=r"enable_rollout_routing_replay=false"):
        ContinuousBatchingEngine(random_qwen2, [0], routed_experts=True)


def new_expert_weights(path) -> dict[str, torch.Tensor]:
    """The served weights with one expert's down projection changed: what a training step on it sends."""
    state = {name: tensor.clone() for name, tensor in reference_model(path).state_dict().items()}
    state[EXPERT_TENSOR][2] += 0.25 * torch.randn(state[EXPERT_TENSOR][2].shape, generator=torch.Generator())
    return state


def test_an_update_of_an_expert_tensor_reaches_the_engine_and_is_checked(moe_dir, prompts):
    from areal_plugins.rollout.cpu.server import CPURolloutServer

    engine_server = server(moe_dir)
    state = new_expert_weights(moe_dir)
    reply = asyncio.run(engine_server.update_weights(state, 1))
    CPURolloutServer.verify_weights(reply, state, 1, "rollout replica 0")  # the check passes: it was loaded
    served = dict(engine_server.engine.model.named_parameters())[EXPERT_TENSOR]
    torch.testing.assert_close(served, state[EXPERT_TENSOR], rtol=0, atol=0)
    # What it generates now is what transformers generates with the new weights.
    updated = copy.deepcopy(reference_model(moe_dir))
    updated.load_state_dict(state)
    updated.generation_config.eos_token_id = None
    result = asyncio.run(engine_server.engine.generate(prompts[0], max_tokens=8, temperature=0.0, ignore_eos=True))
    expected = updated.generate(torch.tensor([prompts[0]]), max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert result.token_ids == expected[0, len(prompts[0]) :].tolist()
    assert result.versions == [1] * 8


def test_an_expert_tensor_lost_on_the_receiving_side_stops_the_update(moe_dir, monkeypatch):
    """The engine loads everything but the changed expert (as a receiver that dropped it would): the checksum it
    answers with is of weights the trainer never had, and the check says so."""
    from areal_plugins.rollout.cpu.server import CPURolloutServer

    engine_server = server(moe_dir)
    state = new_expert_weights(moe_dir)
    load = engine_server.engine.load_state_dict

    def load_without_the_expert(state_dict, version):
        kept = dict(state_dict)
        kept[EXPERT_TENSOR] = engine_server.engine.model.state_dict()[EXPERT_TENSOR].clone()
        load(kept, version)

    monkeypatch.setattr(engine_server.engine, "load_state_dict", load_without_the_expert)
    reply = asyncio.run(engine_server.update_weights(state, 1))
    with pytest.raises(WeightSyncError, match=r"rollout replica 0 failed: the server reports version 1"):
        CPURolloutServer.verify_weights(reply, state, 1, "rollout replica 0")
