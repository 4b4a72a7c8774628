"""A MoE update as verl's trainer sends it (one tensor per expert and projection, the checkpoint's names) loads into
transformers' fused expert parameters exactly as transformers' own checkpoint loading does."""

from __future__ import annotations

import asyncio
import dataclasses
import glob

import pytest
import torch
from safetensors.torch import load_file, save_file

from areal_plugins.rollout.cpu.experts import fuse_expert_tensors
from areal_plugins.tiny.model import WORKLOADS, build_tiny_model

EXPERT = "model.layers.1.mlp.experts.2.up_proj.weight"


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny_moe")
    build_tiny_model(out, dataclasses.replace(WORKLOADS["moe"], warmstart_steps=0))
    return out


def checkpoint(path) -> dict[str, torch.Tensor]:
    """The saved model's tensors under their file names: per expert, as verl's FSDP state dict names them."""
    tensors: dict[str, torch.Tensor] = {}
    for file in glob.glob(str(path / "*.safetensors")):
        tensors.update(load_file(file))
    return tensors


def reference(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def test_per_expert_tensors_load_as_transformers_loads_them(moe_dir, tmp_path):
    from areal_plugins.rollout.cpu.server import CPURolloutServer

    sent = checkpoint(moe_dir)
    assert EXPERT in sent and not any(name.endswith("gate_up_proj") for name in sent)
    sent[EXPERT] = sent[EXPERT] + 0.25  # a training step changed one expert's up projection
    # The independent reference: transformers loading the same tensors from a checkpoint folder.
    changed = tmp_path / "changed"
    reference(moe_dir).save_pretrained(changed)
    for file in glob.glob(str(changed / "*.safetensors")):
        save_file({name: sent[name].contiguous() for name in load_file(file)}, file, metadata={"format": "pt"})
    expected = dict(reference(changed).named_parameters())

    engine_server = CPURolloutServer(str(moe_dir), response_length=8, max_model_len=64)
    reply = asyncio.run(engine_server.update_weights(sent, 1))
    CPURolloutServer.verify_weights(reply, sent, 1, "rollout replica 0")  # the per-update check passes
    served = dict(engine_server.engine.model.named_parameters())
    assert served.keys() == expected.keys()
    for name, tensor in expected.items():
        torch.testing.assert_close(served[name], tensor, rtol=0, atol=0, msg=name)
    # Only the changed rows moved: expert 2's up rows (the second half of its gate_up_proj) in layer 1.
    before = dict(reference(moe_dir).named_parameters())["model.layers.1.mlp.experts.gate_up_proj"]
    moved = (served["model.layers.1.mlp.experts.gate_up_proj"] != before).nonzero()[:, :2].unique(dim=0)
    half = before.shape[1] // 2
    assert {(int(e), int(r) >= half) for e, r in moved} == {(2, True)}


def test_an_update_with_part_of_a_layers_experts_is_refused_naming_what_is_missing(moe_dir):
    sent = checkpoint(moe_dir)
    del sent[EXPERT]
    names = reference(moe_dir).state_dict().keys()
    with pytest.raises(RuntimeError, match=r"part of model\.layers\.1\.mlp\.experts: missing \['" + EXPERT):
        fuse_expert_tensors(sent, names)


def test_a_dense_model_update_passes_through_untouched():
    state = {"model.layers.0.mlp.gate_proj.weight": torch.zeros(2, 2)}
    assert fuse_expert_tensors(state, ["model.layers.0.mlp.gate_proj.weight"]) is state
