"""The areal_cpu engine serving a LoRA adapter (rollout/cpu/lora.py), and the per-update check of it.

The adapter and what is sent are made the way verl 0.9.1's FSDP engine makes them, independently of the engine:
peft's ``get_peft_model`` over the same base model (``LoraConfig(r, lora_alpha, target_modules="all-linear")``), its
LoRA layers' weights set through the modules themselves, and what verl sends, peft's ``get_peft_model_state_dict``
with ``peft_config.to_dict()``. The reference generation is that ``PeftModel``'s own ``generate``. Each refusal test
changes one thing on the receiving side, as a fault would, and the error must name the replica and the tensor.
"""

from __future__ import annotations

import asyncio
import copy
import json

import pytest
import torch

from areal_plugins.rollout.cpu import lora
from areal_plugins.rollout.cpu.engine import ContinuousBatchingEngine
from areal_plugins.weight_sync.checksums import tensor_checksum
from areal_plugins.weight_sync.errors import WeightSyncError

NO_EOS: list[int] = []
RANK, ALPHA = 4, 16  # scaling alpha / r = 4: an adapter applied unscaled (or scaled twice) gives other tokens
#: The tiny Qwen2's LoRA tensors under target_modules="all-linear": 2 layers x 7 linear modules (q, k, v, o, gate,
#: up, down) x 2 (lora_A, lora_B); peft's all-linear leaves out the output layer.
ADAPTER_TENSORS = 2 * 7 * 2
#: Its base parameters, re-checked on every adapter update: 2 layers x 12 (q, k, v weights and biases, o, gate, up,
#: down, two norms), the embedding, the final norm and the tied lm_head under its own name.
BASE_PARAMETERS = 2 * 12 + 3
Q_A0 = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
Q_A1 = "base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight"
V_B1 = "base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"


def trained_adapter(base, seed: int):
    """A ``PeftModel`` over a copy of ``base`` whose LoRA layers hold seeded values, as training would leave them
    (peft's init leaves lora_B at zero: the adapter would change nothing), and what verl sends of it."""
    from peft import LoraConfig, TaskType, get_peft_model
    from peft.utils.save_and_load import get_peft_model_state_dict

    config = LoraConfig(task_type=TaskType.CAUSAL_LM, r=RANK, lora_alpha=ALPHA, target_modules="all-linear")
    model = get_peft_model(copy.deepcopy(base), config).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "lora_A") and "default" in getattr(module, "lora_A", {}):
                for part in (module.lora_A["default"], module.lora_B["default"]):
                    part.weight.copy_(torch.randn(part.weight.shape, generator=generator) * 0.3)
    sent = {name: tensor.detach().clone() for name, tensor in get_peft_model_state_dict(model).items()}
    return model, sent, model.peft_config["default"].to_dict()


def run(coro):
    return asyncio.run(coro)


def greedy(engine: ContinuousBatchingEngine, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    async def go():
        return await asyncio.gather(*[engine.generate(p, max_tokens=tokens, temperature=0.0) for p in prompts])

    return [result.token_ids for result in run(go())]


def test_generation_with_the_adapter_equals_peft_generate(random_qwen2):
    reference, sent, peft_config = trained_adapter(random_qwen2, seed=1)
    engine = ContinuousBatchingEngine(copy.deepcopy(random_qwen2), NO_EOS, max_batch_size=4)
    prompts = [[3, 1, 4, 1, 5], [2, 7], [9] * 11]  # ragged: the batched decode left-pads
    base_tokens = greedy(engine, prompts, 12)
    assert engine.load_adapter(sent, peft_config, version=1) == []
    served = greedy(engine, prompts, 12)
    for prompt, tokens in zip(prompts, served, strict=True):
        expected = reference.generate(
            input_ids=torch.tensor([prompt]), max_new_tokens=12, do_sample=False, pad_token_id=0, eos_token_id=None
        )[0, len(prompt) :].tolist()
        assert tokens == expected
    assert served != base_tokens  # the adapter is what made them: a served base model would fail above

    async def sampled():
        return await engine.generate(prompts[0], max_tokens=9, temperature=0.8)

    result = run(sampled())
    assert result.versions == [1] * 9
    with torch.no_grad():  # the engine's log-probs are the adapted model's, from one forward pass of peft's model
        logits = reference(input_ids=torch.tensor([prompts[0] + result.token_ids])).logits[0].float() / 0.8
    expected_logprobs = torch.log_softmax(logits, -1)[len(prompts[0]) - 1 : -1].gather(
        -1, torch.tensor(result.token_ids)[:, None]
    )[:, 0]
    # As the plain engine against transformers (test_hf_engine.py): cached decode against one full pass.
    torch.testing.assert_close(torch.tensor(result.logprobs), expected_logprobs, atol=1e-4, rtol=0)


def test_adapter_updates_leave_the_base_weights_as_they_were(random_qwen2):
    engine = ContinuousBatchingEngine(copy.deepcopy(random_qwen2), NO_EOS)
    original = {name: tensor.clone() for name, tensor in random_qwen2.state_dict().items()}
    for version, seed in ((1, 1), (2, 2)):
        _, sent, peft_config = trained_adapter(random_qwen2, seed)
        engine.load_adapter(sent, peft_config, version)
        base = engine.base_state_dict()
        assert sorted(base) == sorted(original)
        assert all(torch.equal(base[name], original[name]) for name in original), version
        held = engine.adapter_tensors()
        assert sorted(held) == sorted(sent) and all(torch.equal(held[n], sent[n]) for n in sent)


def test_a_full_update_under_the_adapter_loads_the_base_and_keeps_the_adapter(random_qwen2):
    """verl's base sync (once per trainer process under LoRA) names the wrapped layers' weights with .base_layer."""
    engine = ContinuousBatchingEngine(copy.deepcopy(random_qwen2), NO_EOS)
    _, sent, peft_config = trained_adapter(random_qwen2, seed=1)
    engine.load_adapter(sent, peft_config, version=0)
    shifted = {name: tensor + 0.5 for name, tensor in random_qwen2.state_dict().items()}
    as_verl_names_them = {
        name.replace(".q_proj.weight", ".q_proj.base_layer.weight"): tensor for name, tensor in shifted.items()
    }
    engine.load_state_dict(as_verl_names_them, version=1)
    base = engine.base_state_dict()
    assert all(torch.equal(base[name], shifted[name]) for name in shifted)
    assert all(torch.equal(engine.adapter_tensors()[n], sent[n]) for n in sent)


def test_an_adapter_of_another_shape_mid_run_is_refused(random_qwen2):
    engine = ContinuousBatchingEngine(copy.deepcopy(random_qwen2), NO_EOS)
    _, sent, peft_config = trained_adapter(random_qwen2, seed=1)
    engine.load_adapter(sent, peft_config, version=1)
    with pytest.raises(ValueError, match=r"differs from the one the engine serves in \['r'\]"):
        engine.load_adapter(sent, {**peft_config, "r": 8}, version=2)
    with pytest.raises(ValueError, match="use_dora=True"):
        lora.lora_config({**peft_config, "use_dora": True})


# ---------------------------------------------------------------------------- the server and the per-update check


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from areal_plugins.tiny.model import TinyModelSpec, build_tiny_model

    out = tmp_path_factory.mktemp("cpu_lora_model")
    build_tiny_model(out, TinyModelSpec(warmstart_steps=0, hidden_size=64, intermediate_size=128))
    return out


@pytest.fixture(scope="module")
def base_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa").eval()


def make_server(model_dir, **kwargs):
    from areal_plugins.rollout.cpu.server import CPURolloutServer

    return CPURolloutServer(str(model_dir), response_length=8, max_model_len=64, **kwargs)


def checksums(tensors: dict[str, torch.Tensor]) -> dict[str, list[float]]:
    return {name: tensor_checksum(tensor) for name, tensor in tensors.items()}


def update_and_check(server, received, sent, peft_config, version):
    """The server loads what it ``received``; the check compares it with what the trainer ``sent``."""
    reply = run(server.update_adapter(received, peft_config, version))
    return server.verify_adapter(reply, checksums(sent), version, "rollout replica 0")


def test_each_adapter_update_is_checked_tensor_by_tensor(model_dir, base_model, tmp_path, monkeypatch):
    monkeypatch.setenv("AREAL_RUN_DIR", str(tmp_path))
    server = make_server(model_dir)
    _, sent, peft_config = trained_adapter(base_model, seed=1)
    checked = update_and_check(server, sent, sent, peft_config, version=1)
    assert checked == {"adapter_tensors": ADAPTER_TENSORS, "adapter_ranks": 1, "base_rechecked": BASE_PARAMETERS}
    records = [json.loads(line) for line in (tmp_path / "weight_syncs.jsonl").read_text().splitlines()]
    assert [(r["event"], r["version"]) for r in records] == [("load", 0), ("update_adapter", 1)]
    assert records[1]["checksum"]["adapter_tensors"] == ADAPTER_TENSORS and records[1]["checksum"]["unplaced"] == []


def test_an_adapter_tensor_that_never_arrives_is_refused_naming_it(model_dir, base_model):
    server = make_server(model_dir, replica_rank=3)
    _, sent, peft_config = trained_adapter(base_model, seed=1)
    update_and_check(server, sent, sent, peft_config, version=1)
    _, sent, peft_config = trained_adapter(base_model, seed=2)
    received = {name: tensor for name, tensor in sent.items() if name != V_B1}  # the engine still holds version 1's
    with pytest.raises(WeightSyncError) as error:
        update_and_check(server, received, sent, peft_config, version=2)
    assert str(error.value) == (
        f"rollout replica 3, engine rank 0, update 2: 1 of {ADAPTER_TENSORS} adapter tensors never arrived, e.g. {V_B1}"
    )


def test_an_adapter_tensor_corrupted_on_arrival_is_refused_naming_it(model_dir, base_model, monkeypatch):
    monkeypatch.setenv("AREAL_CORRUPT_RECEIVED_WEIGHT", f"{Q_A1}@2")  # from the server's second update on
    server = make_server(model_dir)
    _, sent, peft_config = trained_adapter(base_model, seed=1)
    update_and_check(server, sent, sent, peft_config, version=1)
    with pytest.raises(WeightSyncError, match=rf"engine rank 0, update 2: adapter tensor {Q_A1} arrived different"):
        update_and_check(server, sent, sent, peft_config, version=2)
    assert sent[Q_A1].view(-1)[0] == trained_adapter(base_model, seed=1)[1][Q_A1].view(-1)[0]  # a copy was changed


def test_an_adapter_tensor_under_another_name_is_refused_naming_both(model_dir, base_model):
    server = make_server(model_dir)
    _, sent, peft_config = trained_adapter(base_model, seed=1)
    elsewhere = Q_A0.replace("layers.0.", "layers.5.")  # no such layer
    received = {elsewhere if name == Q_A0 else name: tensor for name, tensor in sent.items()}
    with pytest.raises(WeightSyncError, match=rf"adapter tensor {Q_A0} was loaded under the name {elsewhere}"):
        update_and_check(server, received, sent, peft_config, version=1)


def test_two_adapter_tensors_swapped_on_arrival_are_refused(model_dir, base_model):
    server = make_server(model_dir)
    _, sent, peft_config = trained_adapter(base_model, seed=1)
    received = {**sent, Q_A0: sent[Q_A1], Q_A1: sent[Q_A0]}  # same shapes: layer 0's and layer 1's q_proj.lora_A
    with pytest.raises(WeightSyncError, match=rf"adapter tensor {Q_A0} arrived different"):
        update_and_check(server, received, sent, peft_config, version=1)


def test_an_adapter_tensor_that_arrives_but_is_not_loaded_is_refused(model_dir, base_model, monkeypatch):
    server = make_server(model_dir)
    _, sent, peft_config = trained_adapter(base_model, seed=1)
    update_and_check(server, sent, sent, peft_config, version=1)
    real_load = lora.load_adapter

    def loses_one(model, tensors):  # a loader that skips a tensor, as vLLM skips a module it does not know
        return real_load(model, {name: tensor for name, tensor in tensors.items() if name != V_B1})

    monkeypatch.setattr(lora, "load_adapter", loses_one)
    _, sent, peft_config = trained_adapter(base_model, seed=2)
    with pytest.raises(WeightSyncError, match=rf"adapter tensor {V_B1} is held as other values than it arrived as"):
        update_and_check(server, sent, sent, peft_config, version=2)


def test_a_base_weight_changed_between_adapter_updates_is_named(model_dir, base_model):
    """verl sends the base once, then adapters only: the adapter's own check cannot see a base weight that changed
    after its load. Each adapter update re-checks the base against the checksums kept from that load."""
    server = make_server(model_dir)
    _, sent, peft_config = trained_adapter(base_model, seed=1)
    assert update_and_check(server, sent, sent, peft_config, version=1)["base_rechecked"] == BASE_PARAMETERS
    norm = server.engine.model.model.layers[1].post_attention_layernorm.weight
    with torch.no_grad():
        norm[0] += 1.0
    _, sent, peft_config = trained_adapter(base_model, seed=2)
    with pytest.raises(
        WeightSyncError,
        match=r"rollout replica 0, engine rank 0, update 2: 1 LoRA base parameter\(s\) changed since the load that "
        r"sent them \(e.g. model.layers.1.post_attention_layernorm.weight\)",
    ):
        update_and_check(server, sent, sent, peft_config, version=2)
    # A full load (verl's base sync) keeps the new values: the next adapter update passes.
    run(server.update_weights(server.engine.base_state_dict(), 2))
    update_and_check(server, sent, sent, peft_config, version=3)


def test_under_lora_sleep_keeps_the_base_weights_verl_sends_once(model_dir, base_model):
    server = make_server(model_dir, free_cache_engine=True, lora_adapter=True)
    _, sent, peft_config = trained_adapter(base_model, seed=1)

    async def scenario():
        await server.sleep()
        asleep = await server.get_stats()
        reply = await server.update_adapter(sent, peft_config, 1)
        await server.wake_up()
        await server.resume_generation()
        out = await server.generate([5, 6, 7], {"max_tokens": 4, "temperature": 0.0}, "r0")
        return asleep, reply, out

    asleep, reply, out = run(scenario())
    assert asleep["weight_bytes"] > 0
    server.verify_adapter(reply, checksums(sent), 1, "rollout replica 0")
    assert out.extra_fields["token_versions"] == [1] * len(out.token_ids)
    # Without the flag an engine serving an adapter refuses to release its weights, naming why.
    with pytest.raises(RuntimeError, match="serving a LoRA adapter"):
        server.engine.release_weights()


# ---------------------------------------------------------------------------- the trainer's side of the update


class InProcessHandle:
    """A Ray actor handle's ``handle.method.remote(...)`` on a server object in this process (no Ray)."""

    def __init__(self, server) -> None:
        self.server = server

    def __getattr__(self, name):
        method = getattr(self.server, name)

        class Remote:
            @staticmethod
            def remote(*args, **kwargs):
                return method(*args, **kwargs)

        return Remote


def trainer_adapter(server, lora_rank: int):
    """Our trainer-side server adapter (rollout/verl_registration.py) bound to ``server``, as verl's worker builds it
    (its constructor needs verl's device mesh and Ray's actor registry, which these tests stand in for)."""
    from types import SimpleNamespace

    from areal_plugins.rollout import verl_registration

    cls = verl_registration.ArealServerAdapter
    adapter = cls.__new__(cls)
    adapter.config = SimpleNamespace(name="areal_cpu")
    adapter.model_config = SimpleNamespace(lora_rank=lora_rank, lora={"merge": False})
    adapter.replica_rank, adapter.is_leader_rank = server.replica_rank, True
    adapter.server_cls = type(server)
    adapter._server = InProcessHandle(server)
    return adapter


def verls_lora_updates(peft_model):
    """What verl 0.9.1's FSDP engine yields for LoRA (``get_per_tensor_param``), by verl's own functions: the base
    weights (``base_sync_done=False``: wrapped layers under ``.base_layer``), then the adapter alone."""
    from verl.utils.fsdp_utils import collect_lora_params, replace_lora_wrapper

    config = peft_model.peft_config["default"]
    base = collect_lora_params(peft_model, layered_summon=False, base_sync_done=False)
    base = {replace_lora_wrapper(name, config): tensor for name, tensor in base.items()}
    adapter = collect_lora_params(peft_model, layered_summon=False, base_sync_done=True)
    return base, dict(adapter), config.to_dict()


def test_verls_colocated_lora_sync_sends_the_base_once_then_checked_adapters(
    model_dir, base_model, tmp_path, monkeypatch
):
    """engine_workers.update_weights' order: at the first update the base (peft_config, base_sync_done=False), then
    the adapter (base_sync_done=True); afterwards the adapter alone. A tensor corrupted on arrival at the server's
    fourth update (the adapter of version 2) stops that update naming the replica and the tensor."""
    monkeypatch.setenv("AREAL_RUN_DIR", str(tmp_path))
    monkeypatch.setenv("AREAL_CORRUPT_RECEIVED_WEIGHT", f"{V_B1}@4")
    server = make_server(model_dir)
    adapter = trainer_adapter(server, lora_rank=RANK)
    peft_model, _, _ = trained_adapter(base_model, seed=1)
    base, tensors, peft_config = verls_lora_updates(peft_model)
    assert any(".base_layer." in name for name in base) and not any("lora_" in name for name in base)
    assert sorted(tensors) == sorted(lora.held_adapter(peft_model.base_model.model))

    async def sync(version: int, first: bool):
        if first:
            await adapter.update_weights(
                iter(base.items()), peft_config=peft_config, base_sync_done=False, global_steps=version
            )
        await adapter.update_weights(
            iter(tensors.items()), peft_config=peft_config, base_sync_done=True, global_steps=version
        )

    run(sync(0, first=True))
    run(sync(1, first=False))
    with pytest.raises(
        WeightSyncError,
        match=rf"rollout replica 0, engine rank 0, update 2: adapter tensor {V_B1} "
        "arrived different from what the trainer sent",
    ):
        run(sync(2, first=False))
    records = [json.loads(line) for line in (tmp_path / "weight_syncs.jsonl").read_text().splitlines()]
    assert [(r["event"], r["version"]) for r in records] == [
        ("load", 0),
        ("update", 0),  # the base weights, once
        ("update_adapter", 0),
        ("update_checked", 0),
        ("update_adapter", 1),
        ("update_checked", 1),
        ("update_adapter", 2),  # loaded, then refused by the check: no update_checked
    ]
    assert all(
        r["checksum"]
        == {
            "adapter_tensors": ADAPTER_TENSORS,
            "adapter_ranks": 1,
            "adapter_only": True,
            "base_rechecked": BASE_PARAMETERS,
        }
        for r in records
        if r["event"] == "update_checked"
    )


def test_an_update_without_the_adapter_under_lora_is_refused(model_dir):
    """verl's checkpoint-engine path (placement: separate) sends base weights and no peft_config (verl #7495)."""
    server = make_server(model_dir)
    adapter = trainer_adapter(server, lora_rank=RANK)
    weights = dict(server.engine.base_state_dict())
    with pytest.raises(WeightSyncError, match=r"trains a LoRA adapter .* but this update carries no adapter"):
        run(adapter.update_weights(iter(weights.items()), global_steps=3))
    assert server.engine.version == 0  # nothing was loaded


def test_a_backend_declaring_the_adapter_check_without_implementing_it_is_refused_before_servers_start(monkeypatch):
    from types import SimpleNamespace

    from areal_plugins.rollout import verl_registration
    from areal_plugins.rollout.base import RolloutServer
    from areal_plugins.rollout.cpu.server import CPURolloutServer

    class Declares(CPURolloutServer):
        update_adapter = RolloutServer.update_adapter

    config = SimpleNamespace(name="areal_cpu", free_cache_engine=False)
    verl_registration.check_capabilities(config)  # ours implements it
    monkeypatch.setattr(verl_registration, "server_class", lambda backend: Declares)
    with pytest.raises(ValueError, match="declares lora_adapter_check, but its server class Declares does not"):
        verl_registration.check_capabilities(config)
