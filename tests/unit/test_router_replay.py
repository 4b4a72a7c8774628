"""Router replay (R3) in the trainer: the recorded experts are used, gate weights come from the trainer's logits.

Expected values are computed here from the router's weight and the hidden states it received (captured by a hook of
the test's own) and from transformers' own ``output_router_logits``, never from the replay code.
"""

from __future__ import annotations

import pytest
import torch
from areal_plugins.patches import fsdp_router_replay
from tensordict import TensorDict
from verl.utils import tensordict_utils as tu

from areal_plugins.tiny.model import TinyModelSpec, random_qwen2_moe
from areal_plugins.trainer_workers import router_replay
from areal_plugins.trainer_workers.router_replay import RouterReplay, RouterReplayError

EXPERTS, TOP_K, LAYERS, TOKENS = 4, 2, 2, 7


def tiny_moe(**overrides):
    spec = TinyModelSpec(hidden_size=32, num_layers=LAYERS, num_heads=2, num_kv_heads=1, intermediate_size=32)
    spec = TinyModelSpec(**{**spec.__dict__, "num_experts": EXPERTS, "experts_per_token": TOP_K, "seed": 3})
    return random_qwen2_moe(spec, vocab_size=64, **overrides).eval()


def input_ids():
    return torch.arange(3, 3 + TOKENS).unsqueeze(0)


def own_routes(model) -> torch.Tensor:
    """(tokens, layers, k): transformers' own top-k of each layer's router logits."""
    with torch.no_grad():
        out = model(input_ids(), output_router_logits=True)
    return torch.stack([torch.topk(layer.float(), TOP_K, dim=-1).indices for layer in out.router_logits], 1)


def other_routes(own: torch.Tensor) -> torch.Tensor:
    """For every token and layer, the two experts the router did not choose (4 experts, top-2)."""
    every = torch.arange(EXPERTS).expand(*own.shape[:2], EXPERTS)
    keep = ~torch.zeros_like(every, dtype=torch.bool).scatter(-1, own, True)
    return every[keep].view(*own.shape[:2], EXPERTS - TOP_K)


def replayed_forward(model, targets):
    """The model's logits with ``targets`` replayed (hooks removed after), and what the replay counted."""
    replay = RouterReplay.install(model)
    try:
        replay.arm(targets, num_layers=LAYERS)
        with torch.no_grad():
            logits = model(input_ids()).logits
        return logits, replay.take_counts()
    finally:
        replay.remove()


class Captured:
    """Each layer's router input and the (index, weights) its experts were called with: hooks of the test's own."""

    def __init__(self, model):
        self.router_inputs: list[torch.Tensor] = []
        self.expert_calls: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.handles = []
        for layer in model.model.layers:
            self.handles.append(layer.mlp.gate.register_forward_pre_hook(self._router_input))
            self.handles.append(layer.mlp.experts.register_forward_pre_hook(self._experts_call))

    def _router_input(self, _module, args):
        self.router_inputs.append(args[0].detach().reshape(-1, args[0].shape[-1]))

    def _experts_call(self, _module, args):
        self.expert_calls.append((args[1].detach(), args[2].detach()))

    def remove(self):
        for handle in self.handles:
            handle.remove()


def test_replaying_the_models_own_routes_changes_nothing():
    model = tiny_moe()
    own = own_routes(model)
    with torch.no_grad():
        plain = model(input_ids()).logits
    replayed, counts = replayed_forward(model, own)
    assert torch.equal(plain, replayed)
    assert counts.replayed == TOKENS * LAYERS and counts.changed == 0


@pytest.mark.parametrize("norm_topk_prob", [False, True])
def test_replayed_experts_get_the_trainers_own_gate_weights_at_them(norm_topk_prob):
    model = tiny_moe(norm_topk_prob=norm_topk_prob)
    targets = other_routes(own_routes(model))
    captured = Captured(model)
    try:
        _, counts = replayed_forward(model, targets)
    finally:
        captured.remove()
    for layer, (hidden, (index, weights)) in enumerate(zip(captured.router_inputs, captured.expert_calls, strict=True)):
        # By hand: softmax over all experts of the router's logits, read at the replayed experts.
        probs = torch.softmax(hidden @ model.model.layers[layer].mlp.gate.weight.T, dim=-1)
        expected = probs.gather(-1, targets[:, layer])
        if norm_topk_prob:
            expected = expected / expected.sum(-1, keepdim=True)
        assert torch.equal(index, targets[:, layer])
        torch.testing.assert_close(weights, expected, rtol=1e-5, atol=1e-6)
    assert counts.replayed == TOKENS * LAYERS and counts.changed == TOKENS * LAYERS


def test_rows_left_unrecorded_route_by_the_trainers_choice():
    model = tiny_moe()
    own = own_routes(model)
    targets = other_routes(own)
    targets[-1] = 0  # the last token: never fed through the engine, its row left at zero
    captured = Captured(model)
    try:
        _, counts = replayed_forward(model, targets)
    finally:
        captured.remove()
    for layer, (index, _weights) in enumerate(captured.expert_calls):
        assert torch.equal(index[:-1], targets[:-1, layer])
        assert torch.equal(index[-1].sort().values, own[-1, layer].sort().values)
    assert counts.replayed == (TOKENS - 1) * LAYERS


def test_the_router_still_learns_under_replay():
    model = tiny_moe().train()
    replay = RouterReplay.install(model)
    try:
        replay.arm(other_routes(own_routes(model)), num_layers=LAYERS)
        model(input_ids(), labels=input_ids()).loss.backward()
    finally:
        replay.remove()
    for layer in model.model.layers:
        assert layer.mlp.gate.weight.grad is not None and layer.mlp.gate.weight.grad.abs().sum() > 0


def test_disarmed_hooks_leave_the_model_as_it_was():
    model = tiny_moe()
    with torch.no_grad():
        plain = model(input_ids()).logits
    replay = RouterReplay.install(model)
    try:
        replay.arm(other_routes(own_routes(model)), num_layers=LAYERS)
        replay.disarm()
        with torch.no_grad():
            after = model(input_ids()).logits
    finally:
        replay.remove()
    assert torch.equal(plain, after)


def test_routes_that_do_not_fit_the_model_are_refused_naming_why():
    model = tiny_moe()
    replay = RouterReplay.install(model)
    try:
        with pytest.raises(RouterReplayError, match="3 layers"):
            replay.arm(torch.ones(TOKENS, 3, TOP_K, dtype=torch.int64), num_layers=LAYERS)
        with pytest.raises(RouterReplayError, match="num_experts_per_tok"):
            replay.arm(torch.ones(TOKENS, LAYERS, 1, dtype=torch.int64), num_layers=LAYERS)
        with pytest.raises(RouterReplayError, match="all zeros"):  # an engine that returned no routes
            replay.arm(torch.zeros(TOKENS, LAYERS, TOP_K, dtype=torch.int64), num_layers=LAYERS)
        replay.arm(torch.ones(TOKENS + 1, LAYERS, TOP_K, dtype=torch.int64), num_layers=LAYERS)
        with pytest.raises(RouterReplayError, match="routes 7 tokens, the recorded routes cover 8"):
            model(input_ids())
    finally:
        replay.remove()


def test_a_dense_model_is_refused():
    from areal_plugins.tiny.model import random_qwen2

    dense = random_qwen2(TinyModelSpec(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1), vocab_size=64)
    with pytest.raises(RouterReplayError, match="enable_rollout_routing_replay=false"):
        RouterReplay.install(dense)


def test_a_record_of_every_decoder_layer_maps_by_absolute_index():
    # 3 decoder layers, the middle one dense (mlp_only_layers): vLLM records 3 slots, output_router_logits lists 2.
    spec = TinyModelSpec(hidden_size=32, num_layers=3, num_heads=2, num_kv_heads=1, intermediate_size=32)
    spec = TinyModelSpec(**{**spec.__dict__, "num_experts": EXPERTS, "experts_per_token": TOP_K})
    model = random_qwen2_moe(spec, vocab_size=64, mlp_only_layers=[1])
    replay = RouterReplay.install(model)
    try:
        assert sorted(replay.routers) == [0, 2]
        assert replay.layer_slots(3, num_layers=3) == {0: 0, 2: 2}
        assert replay.layer_slots(2, num_layers=3) == {0: 0, 2: 1}
    finally:
        replay.remove()


def nested_routes(lengths):
    """Per sequence (length, layers, k) with row j of sequence i holding 10 * i + j in every entry."""
    seqs = [
        torch.full((n, LAYERS, TOP_K), 0, dtype=torch.int16) + (10 * i + torch.arange(n)).view(-1, 1, 1).short()
        for i, n in enumerate(lengths)
    ]
    return torch.nested.nested_tensor(seqs, layout=torch.jagged)


def test_packed_and_padded_layouts_follow_the_tokens():
    routed = nested_routes([3, 2])
    packed = router_replay.packed_rows(routed, pad_rows=2)
    assert packed[:, 0, 0].tolist() == [0, 1, 2, 10, 11, 0, 0]
    padded = router_replay.padded_rows(routed, max_len=4)
    assert padded[:, 0, 0].tolist() == [0, 1, 2, 0, 10, 11, 0, 0]


def micro_batch(lengths, remove_padding):
    ids = torch.nested.nested_tensor([torch.arange(3, 3 + n) for n in lengths], layout=torch.jagged)
    data = TensorDict({"input_ids": ids, "routed_experts": nested_routes(lengths)}, batch_size=[len(lengths)])
    tu.assign_non_tensor(data, use_remove_padding=remove_padding)
    return data


class Engine:
    """The two attributes of verl's FSDP engine the arming reads (its module and its sequence-parallel switch)."""

    def __init__(self, module, use_ulysses_sp=False):
        self.module = module
        self.use_ulysses_sp = use_ulysses_sp


@pytest.mark.parametrize("remove_padding", [True, False])
def test_a_micro_batch_arms_its_engines_routers_in_verls_layout(remove_padding):
    engine = Engine(tiny_moe())
    inputs = {"input_ids": torch.zeros(1, 6) if remove_padding else torch.zeros(2, 4)}
    fsdp_router_replay.arm_from_micro_batch(engine, micro_batch([4, 2], remove_padding), inputs, {"pad_size": 0})
    replay = getattr(engine, fsdp_router_replay.REPLAY_ATTRIBUTE)
    try:
        assert router_replay.ARMED is replay
        rows = replay._targets[:, 0, 0].tolist()
        assert rows == ([0, 1, 2, 3, 10, 11] if remove_padding else [0, 1, 2, 3, 10, 11, 0, 0])
    finally:
        replay.remove()
        router_replay.ARMED = None


def test_a_micro_batch_without_routes_is_refused():
    engine = Engine(tiny_moe())
    data = micro_batch([2], True).exclude("routed_experts")
    with pytest.raises(RouterReplayError, match="no routed_experts"):
        fsdp_router_replay.arm_from_micro_batch(engine, data, {"input_ids": torch.zeros(1, 2)}, {})
    getattr(engine, fsdp_router_replay.REPLAY_ATTRIBUTE).remove()


def test_sequence_parallel_is_refused():
    engine = Engine(tiny_moe(), use_ulysses_sp=True)
    with pytest.raises(RouterReplayError, match="ulysses_sequence_parallel_size=1"):
        fsdp_router_replay.arm_from_micro_batch(engine, micro_batch([2], True), {"input_ids": torch.zeros(1, 2)}, {})
    getattr(engine, fsdp_router_replay.REPLAY_ATTRIBUTE).remove()


def test_the_patch_wraps_verls_engine_and_reverts_to_the_same_object():
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    original = FSDPEngineWithLMHead.__dict__["prepare_model_inputs"]
    fsdp_router_replay.apply()
    try:
        patched = FSDPEngineWithLMHead.__dict__["prepare_model_inputs"]
        assert patched is not original and patched.__wrapped__ is original
        fsdp_router_replay.apply()  # idempotent
        assert FSDPEngineWithLMHead.__dict__["prepare_model_inputs"] is patched
    finally:
        fsdp_router_replay.revert()
    assert FSDPEngineWithLMHead.__dict__["prepare_model_inputs"] is original
    assert not fsdp_router_replay.is_applied()


def test_the_patch_refuses_another_verl():
    with pytest.raises(Exception, match=r"0\.9\.0"):
        fsdp_router_replay.PATCH.apply(verl_version="0.9.0")
    assert not fsdp_router_replay.is_applied()


def test_an_engine_that_routes_otherwise_is_matched_only_with_replay():
    """By construction (areal_plugins.testing.router_bias): the engine's routers prefer expert 0 in their choice.
    What it records is what it used; the trainer, unbiased, matches its logits only when it replays them."""
    from areal_plugins.testing.router_bias import install_router_choice_bias

    engine, trainer = tiny_moe(), tiny_moe()  # the same seed: the same weights
    handles = install_router_choice_bias(engine, expert=0, bias=3.0)
    captured = Captured(engine)
    try:
        with torch.no_grad():
            out = engine(input_ids(), output_router_logits=True)
        recorded = torch.stack([torch.topk(layer.float(), TOP_K, dim=-1).indices for layer in out.router_logits], 1)
    finally:
        captured.remove()
        for handle in handles:
            handle.remove()
    for layer, (index, _weights) in enumerate(captured.expert_calls):
        assert torch.equal(index.sort(-1).values, recorded[:, layer].sort(-1).values)  # recorded what it used
    # The trainer's own choice on the hidden states the replay gives it (the engine's): the logits without the bias.
    unbiased = [layer.float() - 3.0 * (torch.arange(EXPERTS) == 0) for layer in out.router_logits]
    own = torch.stack([torch.topk(layer, TOP_K, dim=-1).indices for layer in unbiased], 1)
    flipped = int((recorded.sort(-1).values != own.sort(-1).values).any(-1).sum())
    assert flipped > 0, "the bias flipped no route: the construction shows nothing"
    with torch.no_grad():
        unreplayed = trainer(input_ids()).logits
    replayed, counts = replayed_forward(trainer, recorded)
    assert torch.equal(replayed, out.logits)
    assert not torch.allclose(unreplayed, out.logits)
    assert counts.changed == flipped
