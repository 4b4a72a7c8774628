"""verl's validation goes ahead of the training backlog on verl's ``vllm`` under ``areal_async`` (issue 47, item 7).

Our server sends a validation request (``VALIDATION_KWARG``, set by our client) to vLLM with the lowest priority, and
``areal.enable`` in async mode routes ``rollout.scheduling_policy: priority``. Here: vLLM 0.30.0's own scheduler (the
CPU build's, the one the engine core runs, driven step by step with a stand-in model's outputs) admits such a request
ahead of every waiting one and preempts no running one for it; under verl's default ``fcfs`` the same request
finishes last. Then our server's part: the priority it passes, and holds that never hold validation.
"""

from __future__ import annotations

import asyncio
import inspect
from typing import Any

import pytest
import torch

from areal_plugins.rollout.base import VALIDATION_KWARG, VALIDATION_PRIORITY

#: Every request decodes this many tokens (end-of-sequence ignored): one from its prefill, one per decode step.
TOKENS = 4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny Qwen2's config (vLLM's scheduler reads the model's config; no weights are loaded)."""
    from areal_plugins.tiny.model import TinyModelSpec, random_qwen2

    out = tmp_path_factory.mktemp("tiny_qwen2")
    spec = TinyModelSpec(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2, seed=0)
    random_qwen2(spec, vocab_size=256).save_pretrained(out)
    return str(out)


def scheduler(model_dir: str, policy: str, max_num_seqs: int = 2) -> Any:
    """vLLM's V1 scheduler as its engine core builds it, with room for ``max_num_seqs`` running requests."""
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    blocks, block_size = 1000, 16
    config = VllmConfig(
        scheduler_config=SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=256,
            max_model_len=64,
            enable_chunked_prefill=True,
            policy=policy,
            is_encoder_decoder=False,
        ),
        model_config=ModelConfig(model=model_dir, skip_tokenizer_init=True, dtype="float32", seed=0, max_model_len=64),
        cache_config=CacheConfig(block_size=block_size, enable_prefix_caching=False),
    )
    config.cache_config.num_gpu_blocks = blocks
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=1, dtype=torch.float32)
    kv_cache = KVCacheConfig(num_blocks=blocks, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["l"], spec)])
    return Scheduler(
        vllm_config=config,
        kv_cache_config=kv_cache,
        structured_output_manager=StructuredOutputManager(config),
        block_size=block_size,
    )


def request(request_id: str, arrival: float, priority: int = 0) -> Any:
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    params = SamplingParams(max_tokens=TOKENS, ignore_eos=True)
    return Request(request_id, [1, 2, 3], params, None, arrival_time=arrival, priority=priority)


def finish_order(sched: Any, backlog: int, validation_priority: int) -> list[str]:
    """``backlog`` training requests (priority 0, verl's), then, after the first step, a validation request; step the
    scheduler (each scheduled request samples one token) until every request finished; their finish order."""
    from vllm.v1.outputs import ModelRunnerOutput

    for i in range(backlog):
        sched.add_request(request(f"t{i}", arrival=float(i)))
    finished: list[str] = []
    steps = 0
    while sched.has_requests():
        scheduled = sched.schedule()
        steps += 1
        ids = [r.req_id for r in scheduled.scheduled_new_reqs] + list(scheduled.scheduled_cached_reqs.req_ids)
        sampled = ModelRunnerOutput(
            req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)}, sampled_token_ids=[[7] for _ in ids]
        )
        for outputs in sched.update_from_output(scheduled, sampled).values():
            finished.extend(o.request_id for o in outputs.outputs if o.finish_reason is not None)
        if steps == 1:  # t0 and t1 are running, the rest wait
            sched.add_request(request("val", arrival=float(backlog), priority=validation_priority))
        assert steps < 100, "the scheduler stopped making progress"
    return finished


def test_vllms_priority_scheduler_admits_a_validation_request_ahead_of_the_waiting_backlog(model_dir):
    # By hand, 2 running slots, 4 tokens a request: t0 and t1 run in steps 1-4 (not preempted for the validation
    # request, which arrives after step 1); the slots they free go to the validation request, then t2; then t3, t4,
    # then t5.
    order = finish_order(scheduler(model_dir, "priority"), backlog=6, validation_priority=VALIDATION_PRIORITY)
    assert order == ["t0", "t1", "val", "t2", "t3", "t4", "t5"]


def test_under_verls_default_fcfs_the_priority_is_ignored_and_validation_waits_for_the_backlog(model_dir):
    """Why ``areal.enable`` routes ``scheduling_policy: priority``: vLLM's fcfs queue ignores every priority."""
    order = finish_order(scheduler(model_dir, "fcfs"), backlog=6, validation_priority=VALIDATION_PRIORITY)
    assert order[-1] == "val"


def test_verl_passes_the_rollout_scheduling_policy_to_vllms_engine():
    """The route reaches vLLM only through verl's server, which copies ``rollout.scheduling_policy`` into vLLM's engine
    arguments (verl 0.9.1, ``vllm_async_server.py``); a verl that stops doing so leaves the route without effect."""
    from verl.workers.rollout.vllm_rollout.vllm_async_server import vLLMHttpServer

    source = inspect.getsource(vLLMHttpServer)
    assert '"scheduling_policy": self.config.scheduling_policy' in source
    assert "priority=priority" in inspect.getsource(vLLMHttpServer.generate)  # what it hands vLLM's generate


# ---------------------------------------------------------------------- our server: the priority, and no hold


def server_with_holds(groups: int) -> Any:
    """Our server's state for ``generate`` as ``__init__`` sets it (no engine is launched)."""
    from areal_plugins.rollout.activity import RequestActivity
    from areal_plugins.rollout.verl_vllm.server import ArealVLLMHttpServer
    from areal_plugins.testing.holds import FinishFirstGroups

    server = object.__new__(ArealVLLMHttpServer)
    server._entering_engine = set()
    server.generated_tokens = 0
    server.activity = RequestActivity()
    server.prompt_seeds = None
    server.holds = FinishFirstGroups(groups, 1)
    server._release_held = asyncio.Event()
    return server


def test_our_server_sends_a_validation_request_at_the_lowest_priority_and_never_holds_it(monkeypatch):
    from verl.workers.rollout.replica import TokenOutput
    from verl.workers.rollout.vllm_rollout.vllm_async_server import vLLMHttpServer

    calls: dict[str, dict[str, Any]] = {}

    async def verls_generate(self, prompt_ids, sampling_params, request_id, *args, **kwargs):
        calls[request_id] = {"max_tokens": sampling_params.get("max_tokens"), **kwargs}
        return TokenOutput(token_ids=[9], log_probs=[-0.1], stop_reason="completed", extra_fields={})

    monkeypatch.setattr(vLLMHttpServer, "generate", verls_generate)
    server = server_with_holds(groups=1)  # one group finishes per version; the others are held after 1 token

    async def scenario() -> None:
        params = {"max_tokens": 8}
        # A held request would wait for an abort that never comes: bounded, so that a hold fails instead of hanging.
        validation = server.generate([40, 41], dict(params), "val", priority=0, **{VALIDATION_KWARG: True})
        await asyncio.wait_for(validation, timeout=10)
        training = server.generate([5, 6], dict(params), "train-a", priority=0)  # still the group that finishes
        await asyncio.wait_for(training, timeout=10)
        held = asyncio.create_task(server.generate([7, 8], dict(params), "train-b", priority=0))
        await asyncio.sleep(0.05)
        assert not held.done()  # held until the next abort releases it
        server._release_held.set()
        assert (await held).stop_reason == "aborted"

    asyncio.run(scenario())
    assert calls["val"] == {"max_tokens": 8, "priority": VALIDATION_PRIORITY}  # no mark left for verl's generate
    assert calls["train-a"] == {"max_tokens": 8, "priority": 0}
    assert calls["train-b"] == {"max_tokens": 1, "priority": 0}  # held after its one token
