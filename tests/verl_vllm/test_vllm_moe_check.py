"""A mixture-of-experts update checked after loading in a real vLLM CPU engine (needs vLLM: ``.venv-verl-vllm``).

One in-process engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, no Ray) on the tiny Qwen2-MoE (2 layers, 4 experts, 2
per token, a shared expert) with our worker extension, started from dummy weights as verl starts it. Each update is
what verl's FSDP trainer sends: transformers' state dict, whose experts are fused (``mlp.experts.gate_up_proj``),
cut per expert by verl's own ``unfuse_moe_params`` (``mlp.experts.E.gate_proj.weight``, ``up_proj``, ``down_proj``),
through verl's ``BucketedWeightSender`` into ``update_weights_from_ipc``. vLLM stacks them into one ``w13_weight``
and one ``w2_weight`` per layer; the after-load check (rollout/verl_vllm/loaded_weights.py) compares each with the
sums of the tensors vLLM's expert mapping loads into it, here computed again from what was sent. Faults are injected
on the receiving side (the worker extension's fault-injection variables).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from areal_plugins.patches import vllm_cpu_moe_reload

from areal_plugins.testing import faults
from areal_plugins.weight_sync.checksums import check_loaded_reports, check_weight_reports, tensor_checksum
from areal_plugins.weight_sync.errors import WeightSyncError
from tests.verl_vllm.extension_engine import ExtensionEngine, started

MODEL = Path(__file__).resolve().parents[2] / ".areal" / "tiny_moe" / "model"
LAYERS, EXPERTS = 2, 4
EXPERT_PARAMETER = "model.layers.{layer}.mlp.experts.routed_experts.{parameter}"
PROMPT = [16384, 5, 7, 9, 11]

pytestmark = pytest.mark.skipif(
    not (MODEL / "config.json").exists(),
    reason="build it: areal-plugins build-tiny --workload moe --out .areal/tiny_moe",
)


def trainer_update(seed: int) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """The tiny MoE with its matrices redrawn (std 0.3: at the checkpoint's scale every token routes alike) and the
    update verl's FSDP engine sends of it."""
    from transformers import AutoModelForCausalLM
    from verl.workers.engine.fsdp.utils import unfuse_moe_params

    model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() >= 2:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.3)
    state = ((name, tensor.detach().clone()) for name, tensor in model.state_dict().items())
    return model, dict(unfuse_moe_params(state, model.config.model_type))


def stacked(sent: dict[str, torch.Tensor], layer: int, parameter: str) -> torch.Tensor:
    """vLLM's layout of a layer's experts as sent: ``w13``, each expert's gate rows then its up rows; ``w2``, down."""
    prefix = f"model.layers.{layer}.mlp.experts"
    projections = ("gate_proj", "up_proj") if parameter == "w13_weight" else ("down_proj",)
    return torch.stack([torch.cat([sent[f"{prefix}.{e}.{p}.weight"] for p in projections]) for e in range(EXPERTS)])


class Engine(ExtensionEngine):
    """An engine whose greedy answers come with their log-probs."""

    def greedy(self, prompt: list[int], tokens: int) -> tuple[list[int], list[float]]:
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True, logprobs=1)
        output = self.llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0]
        ids = list(output.token_ids)
        return ids, [step[token].logprob for step, token in zip(output.logprobs, ids, strict=True)]


def transformers_greedy(model: torch.nn.Module, prompt: list[int], tokens: int) -> tuple[list[int], list[float]]:
    ids, logprobs = torch.tensor([prompt]), []
    with torch.no_grad():
        for _ in range(tokens):
            scores = model(input_ids=ids).logits[0, -1].log_softmax(-1)
            ids = torch.cat([ids, scores.argmax().view(1, 1)], dim=1)
            logprobs.append(float(scores.max()))
    return ids[0, len(prompt) :].tolist(), logprobs


@pytest.fixture(scope="module")
def engine():
    with started(Engine, MODEL, "moe-check") as engine:
        yield engine


def test_every_expert_tensor_is_compared_and_the_engine_samples_with_them(engine):
    model, sent = trainer_update(seed=1)
    assert sum(".mlp.experts." in name for name in sent) == LAYERS * EXPERTS * 3
    report = engine.update(sent)
    check_weight_reports([report], {name: tensor_checksum(t) for name, t in sent.items()}, "replica 0", 1)
    check_loaded_reports([report], "replica 0")
    loaded = report["loaded"]
    assert loaded["not_held"] == [] and not [name for name in loaded["unchecked"] if "experts" in name]
    assert loaded["experts"]["parameters"] == loaded["experts"]["compared"] == LAYERS * 2  # w13 and w2 per layer
    for layer in range(LAYERS):
        for parameter in ("w13_weight", "w2_weight"):
            entry = loaded["entries"][EXPERT_PARAMETER.format(layer=layer, parameter=parameter)]
            expected = tensor_checksum(stacked(sent, layer, parameter), positions=False)
            assert entry["expected"] == pytest.approx(expected, rel=1e-9) and not entry["sharded"]
            assert entry["held"][1:] == pytest.approx(expected[1:], rel=1e-9)
    # What the check compared is what the engine samples with: greedy tokens and their log-probs equal
    # transformers' own forward pass with the same weights.
    tokens, logprobs = engine.greedy(PROMPT, 8)
    expected_tokens, expected_logprobs = transformers_greedy(model, PROMPT, 8)
    assert tokens == expected_tokens
    assert logprobs == pytest.approx(expected_logprobs, abs=1e-3)


@pytest.mark.parametrize(("layer", "parameter"), [(0, "w13_weight"), (1, "w2_weight")])
def test_a_value_changed_in_an_expert_parameter_after_loading_is_named(engine, monkeypatch, layer, parameter):
    _, sent = trainer_update(seed=2)
    name = EXPERT_PARAMETER.format(layer=layer, parameter=parameter)
    monkeypatch.setenv(faults.CORRUPT_LOADED_ENV, name)
    report = engine.update(sent)
    with pytest.raises(WeightSyncError, match=rf"worker rank 0: parameter {name} holds after loading something other"):
        check_loaded_reports([report], "replica 0")


def test_an_expert_tensor_under_a_name_no_expert_has_is_named(engine, monkeypatch):
    """vLLM's expert loader loads a name its mapping does not match into nothing, and says nothing."""
    _, sent = trainer_update(seed=3)
    lost = "model.layers.0.mlp.experts.3.down_proj.weight"
    monkeypatch.setenv(faults.RENAME_RECEIVED_ENV, f"{lost}={lost.replace('.3.', '.4.')}")
    report = engine.update(sent)
    with pytest.raises(WeightSyncError, match=r"received 1 tensors that no engine parameter holds .* e\.g\. .*\.4\."):
        check_loaded_reports([report], "replica 0")
    assert EXPERT_PARAMETER.format(layer=0, parameter="w2_weight") in report["loaded"]["unchecked"]  # expert 3 lost


def test_an_expert_tensor_lost_on_the_way_is_named_by_the_transport_check_not_taken_for_a_bad_load(engine, monkeypatch):
    _, sent = trainer_update(seed=4)
    lost = "model.layers.1.mlp.experts.2.up_proj.weight"
    monkeypatch.setenv(faults.DROP_RECEIVED_ENV, lost)
    report = engine.update(sent)
    compared = check_loaded_reports([report], "replica 0")  # w13 of layer 1 lacks a source: not compared
    assert EXPERT_PARAMETER.format(layer=1, parameter="w13_weight") in compared["loaded_not_compared_examples"]
    with pytest.raises(WeightSyncError, match=rf"{lost}"):
        check_weight_reports([report], {name: tensor_checksum(t) for name, t in sent.items()}, "replica 0", 1)


def test_without_the_reload_patch_vllm_samples_from_experts_it_left_unpacked(engine, monkeypatch):
    """Why patches/vllm_cpu_moe_reload.py exists: vLLM 0.30's CPU build reloads the experts in checkpoint order into
    a kernel that reads them packed. The values are the same, so the check passes; only sampling shows it."""
    model, sent = trainer_update(seed=5)
    vllm_cpu_moe_reload.revert()
    try:
        with pytest.raises(RuntimeError, match=r"vLLM 0\.31\.0's CPU build is not known to pack"):
            vllm_cpu_moe_reload.apply("0.31.0")
        monkeypatch.setattr(vllm_cpu_moe_reload, "apply", lambda *args, **kwargs: None)
        check_loaded_reports([engine.update(sent)], "replica 0")
        _, logprobs = engine.greedy(PROMPT, 8)
        _, expected_logprobs = transformers_greedy(model, PROMPT, 8)
        assert logprobs != pytest.approx(expected_logprobs, abs=1e-2)
    finally:
        monkeypatch.undo()
        vllm_cpu_moe_reload.apply()
