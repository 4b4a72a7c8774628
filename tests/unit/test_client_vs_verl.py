"""Our rollout client keeps every field verl's own ``FullyAsyncLLMServerClient`` keeps across an interrupted request.

Both clients are driven through the same scripted server (no Ray: a stand-in load balancer hands out a stand-in
server whose ``generate`` answers from a script): the first request is aborted by a weight update with part of the
answer, the resubmission (prompt + partial output) completes it. The outputs are compared field by field; the
expected values are written out by hand from the script, so a field both clients dropped would fail too.
"""

from __future__ import annotations

import asyncio
import hashlib
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from omegaconf import OmegaConf
from verl.workers.rollout import llm_server
from verl.workers.rollout.replica import TokenOutput

from areal_plugins.agent_loop.llm_client import InterruptibleLLMClient
from areal_plugins.agent_loop.routed_experts import RoutesNotRecordedError

PROMPT = [1, 2, 3]
LAYERS, TOP_K = 2, 2


def experts(first: int, rows: int) -> np.ndarray:
    """Expert ids per (token, layer, slot): row r holds (first + r) x k + slot in every layer, so a misplaced or
    dropped row shows, and each row names k distinct experts, as a top-k router's does."""
    rows_ids = np.arange(first, first + rows, dtype=np.int32)[:, None, None] * TOP_K
    return rows_ids + np.arange(TOP_K, dtype=np.int32)[None, None, :] + np.zeros((1, LAYERS, 1), np.int32)


def script() -> list[TokenOutput]:
    """What vLLM returns: an abort with 2 of the answer's tokens (routed experts for the 3 prompt rows + 2), then the
    resubmitted prompt + partial (5 rows routed again under version 1: ids 100-104) and 3 new tokens."""
    return [
        TokenOutput(
            token_ids=[11, 12],
            log_probs=[-0.1, -0.2],
            routed_experts=experts(0, 5),
            stop_reason="aborted",
            num_preempted=1,
            extra_fields={"global_steps": 0, "num_cached_tokens": 2, "engine_note": "a"},
        ),
        TokenOutput(
            token_ids=[13, 14, 15],
            log_probs=[-0.3, -0.4, -0.5],
            routed_experts=experts(100, 8),
            stop_reason="completed",
            num_preempted=2,
            extra_fields={"global_steps": 1, "num_cached_tokens": 5, "engine_note": "b"},
        ),
    ]


class ScriptedServer:
    """A rollout server's handle: ``generate.remote(...)`` answers the next scripted output."""

    def __init__(self, outputs: list[TokenOutput]) -> None:
        self.outputs = outputs
        self.prompts: list[list[int]] = []
        self.generate = SimpleNamespace(remote=self._generate)

    async def _generate(self, *, request_id: str, prompt_ids: list[int], sampling_params: dict, **kwargs: Any):
        self.prompts.append(list(prompt_ids))
        return self.outputs.pop(0).model_copy(deep=True)


class OneServerBalancer:
    """verl's load balancer's calls, as the base client makes them, over one server."""

    def __init__(self, server: ScriptedServer) -> None:
        async def fields() -> list[str]:
            return []

        async def acquire(request_id: str, **fields: Any) -> tuple[str, ScriptedServer]:
            return "s0", server

        self.require_acquire_fields = SimpleNamespace(remote=fields)
        self.require_release_fields = SimpleNamespace(remote=fields)
        self.acquire_server = SimpleNamespace(remote=acquire)
        self.release_server = SimpleNamespace(remote=lambda **kwargs: None)  # fire and forget


@pytest.fixture(autouse=True)
def no_retry_pause(monkeypatch):
    """verl's client sleeps 1 s before each resubmission; the comparison needs none of it."""

    async def no_pause(seconds: float) -> None:
        await asyncio.sleep(0)

    monkeypatch.setattr(llm_server, "asyncio", SimpleNamespace(sleep=no_pause, gather=asyncio.gather))


CONFIG = {"actor_rollout_ref": {"rollout": {"name": "vllm", "response_length": 8}}, "trainer": {"save_freq": -1}}


def run(client_class: type, outputs: list[TokenOutput]) -> tuple[TokenOutput, list[list[int]]]:
    server = ScriptedServer(outputs)
    client = client_class(OmegaConf.create(CONFIG), OneServerBalancer(server))
    output = asyncio.run(client.generate("r1", prompt_ids=list(PROMPT), sampling_params={"max_tokens": 8}))
    return output, server.prompts


def test_both_clients_keep_the_same_fields_of_an_interrupted_request():
    ours, our_prompts = run(InterruptibleLLMClient, script())
    verls, verl_prompts = run(llm_server.FullyAsyncLLMServerClient, script())
    # The same requests reached the server: the prompt, then the prompt and the partial answer.
    assert our_prompts == verl_prompts == [PROMPT, [*PROMPT, 11, 12]]
    # By hand from the script: 3 prompt rows and 2 tokens' rows of the first request, then the rows of the 3 new
    # tokens only (the second request's last 3 of 8: ids 105-107).
    expected_experts = np.concatenate([experts(0, 5), experts(105, 3)])
    expected = {
        "token_ids": [11, 12, 13, 14, 15],
        "log_probs": [-0.1, -0.2, -0.3, -0.4, -0.5],
        "stop_reason": "completed",
        "num_preempted": 3,  # 1 + 2, summed
    }
    for name, value in expected.items():
        assert getattr(ours, name) == getattr(verls, name) == value, name
    assert ours.routed_experts.shape == verls.routed_experts.shape == (8, LAYERS, TOP_K)
    np.testing.assert_array_equal(verls.routed_experts, expected_experts)
    np.testing.assert_array_equal(ours.routed_experts, expected_experts)
    # Every extra field verl keeps, with verl's value: the first prefill's cache hits, the versions' span.
    kept_by_verl = {"global_steps": 1, "min_global_steps": 0, "max_global_steps": 1, "num_cached_tokens": 2}
    assert verls.extra_fields == kept_by_verl
    for name, value in verls.extra_fields.items():
        assert ours.extra_fields[name] == value, name
    # ... and ours adds the per-token versions on top.
    assert ours.extra_fields["token_versions"] == [0, 0, 1, 1, 1]
    assert ours.extra_fields["num_interrupts"] == 1
    # ... and, for the run's records, how many positions the merged routing covers and its digest (int32 ids).
    digest = hashlib.sha256(expected_experts.astype("<i4").tobytes()).hexdigest()[:16]
    assert ours.extra_fields["areal_routed_experts"] == [8, digest]


def test_a_first_request_aborted_before_any_token_keeps_the_next_requests_whole_routing():
    """An abort that returned no token adds no rows (verl's rule): the resubmission's whole array is the routing."""
    outputs = script()
    outputs.insert(
        0,
        TokenOutput(
            token_ids=[],
            log_probs=[],
            routed_experts=experts(50, 3),
            stop_reason="aborted",
            num_preempted=None,
            extra_fields={"global_steps": 0},
        ),
    )
    ours, _ = run(InterruptibleLLMClient, [o.model_copy(deep=True) for o in outputs])
    verls, _ = run(llm_server.FullyAsyncLLMServerClient, outputs)
    expected_experts = np.concatenate([experts(0, 5), experts(105, 3)])  # nothing of ids 50-52
    np.testing.assert_array_equal(verls.routed_experts, expected_experts)
    np.testing.assert_array_equal(ours.routed_experts, expected_experts)
    assert ours.num_preempted == verls.num_preempted == 3  # None counts as nothing
    assert ours.extra_fields["num_cached_tokens"] == verls.extra_fields["num_cached_tokens"] == 2


def test_an_engine_without_routing_or_preemption_counts_gives_what_verl_gives():
    outputs = script()
    for output in outputs:
        output.routed_experts = None
        output.num_preempted = None
        output.extra_fields.pop("num_cached_tokens")
    ours, _ = run(InterruptibleLLMClient, [o.model_copy(deep=True) for o in outputs])
    verls, _ = run(llm_server.FullyAsyncLLMServerClient, outputs)
    assert ours.routed_experts is None and verls.routed_experts is None
    assert ours.num_preempted == verls.num_preempted == 0
    assert ours.extra_fields["num_cached_tokens"] is None and verls.extra_fields["num_cached_tokens"] is None


def test_routes_an_engine_never_recorded_stop_the_request_naming_the_fix():
    """vLLM's CPU build under torch.compile returns every route as zeros (seen through verl's server): a row naming
    one expert twice is no top-k router's choice, so the client stops instead of handing made-up routes to replay."""
    outputs = script()
    outputs[1].routed_experts[-2] = 0  # the resubmission's second-to-last new token: [0, 0] in every layer
    with pytest.raises(RoutesNotRecordedError, match=r"in 2 of 6 \(token, layer\) slots.*enforce_eager=true"):
        run(InterruptibleLLMClient, outputs)
    outputs = script()
    outputs[0].routed_experts[0] = 0  # a prompt row of the first request
    with pytest.raises(RoutesNotRecordedError, match=r"in 2 of 10 \(token, layer\) slots, e\.g\. \[0, 0\]"):
        run(InterruptibleLLMClient, outputs)


def test_a_resubmitted_prefix_is_not_checked_again():
    """Only the new tokens' rows of a resubmission are kept (verl's rule), so only those are checked."""
    outputs = script()
    outputs[1].routed_experts[0] = 0  # a prompt row routed again under version 1: dropped
    ours, _ = run(InterruptibleLLMClient, outputs)
    np.testing.assert_array_equal(ours.routed_experts, np.concatenate([experts(0, 5), experts(105, 3)]))
