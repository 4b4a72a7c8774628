"""Router replay's input from verl's vLLM: vLLM's CPU build returns the experts it routed each token to, and they are
the experts transformers' own routers choose with the same weights (needs vLLM: ``.venv-verl-vllm``).

verl's vLLM server passes ``enable_return_routed_experts`` when ``rollout.enable_rollout_routing_replay`` is set and
hands each output's ``routed_experts`` to the client (``vllm_async_server.py``), which keeps them across interrupted
chunks (tests/unit/test_client_vs_verl.py). Here: one in-process engine with our worker extension, weights sent as
verl's FSDP trainer sends them, a greedy answer, and its routes against the routers' top-k of a transformers forward
pass over the same tokens.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.verl_vllm.extension_engine import started
from tests.verl_vllm.test_vllm_moe_check import LAYERS, MODEL, PROMPT, Engine, trainer_update

pytestmark = pytest.mark.skipif(
    not (MODEL / "config.json").exists(),
    reason="build it: areal-plugins build-tiny --workload moe --out .areal/tiny_moe",
)
TOKENS = 8


def test_vllm_returns_the_experts_transformers_routes_each_token_to():
    from vllm import SamplingParams

    model, sent = trainer_update(seed=11)
    with started(Engine, MODEL, "routes", enable_return_routed_experts=True) as engine:
        engine.update(sent)
        params = SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True)
        output = engine.llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)[0].outputs[0]
    answer = list(output.token_ids)
    routed = np.asarray(output.routed_experts)
    # Every token fed through the model: the prompt and the answer but its last token.
    fed = PROMPT + answer[:-1]
    assert routed.shape == (len(fed), LAYERS, model.config.num_experts_per_tok)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([fed]), output_router_logits=True).router_logits
    expected = np.stack([torch.topk(layer.float(), routed.shape[2], dim=-1).indices.numpy() for layer in logits], 1)
    assert (np.sort(routed, -1) == np.sort(expected, -1)).all()
