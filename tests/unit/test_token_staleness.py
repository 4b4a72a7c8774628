"""One staleness for every bench row (tools/areal_bench/token_staleness.py) and the read-only record of verl's rows
that feeds it (tools/areal_bench/verl_token_versions.py). Expected figures are derived by hand in each test."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from areal_plugins._compat import UnsupportedVerlVersionError
from tests.unit.tool_scripts import load_tool

load_tool("repeats")  # puts tools/ on sys.path, as when a tool runs as a script
from areal_bench import token_staleness  # noqa: E402
from areal_bench.token_staleness import StalenessTally, tally_records, token_versions  # noqa: E402


def test_each_request_covers_the_tokens_up_to_the_next_ones_start():
    # 8 response tokens: tokens 0-4 from version 3, then (cut by an update) 5-7 from version 4
    assert token_versions([[5, 4, None], [0, 3, 11]], 8) == [(3, 5), (4, 3)]
    assert token_versions([[0, 2, None], [3, 3, None], [9, 4, None]], 6) == [(2, 3), (3, 3)]  # one past the end
    assert token_versions([], 0) == []
    with pytest.raises(ValueError, match="do not cover the first of 4 response tokens"):
        token_versions([[2, 1, None]], 4)


def test_the_token_mean_weights_each_version_by_the_tokens_it_generated():
    """Trained from T = 5: trajectory A, 5 tokens of version 3 and 3 of version 4 (staleness 2 and 1); B, 4 tokens
    of version 5. Per token: (5 x 2 + 3 x 1 + 4 x 0) / 12 = 13/12; per trajectory from the head: (2 + 0) / 2 = 1;
    from the newest (verl's lower bound): (1 + 0) / 2 = 0.5; the stalest token: 2."""
    tally = StalenessTally()
    tally.add(5, [[0, 3, None], [5, 4, None]], 8)
    tally.add(5, [[0, 5, None]], 4)
    assert tally.figures() == {
        "token_staleness_mean": pytest.approx(13 / 12),
        "token_staleness_max": 2.0,
        "head_staleness_mean": 1.0,
        "head_staleness_max": 2.0,
        "newest_staleness_mean": 0.5,
    }
    assert StalenessTally().figures() == {}


def test_records_of_warm_up_steps_are_left_out_and_unrecorded_trajectories_counted():
    records = [
        {"step": 1, "trainer_version": 0, "chunks": [[0, 0, None]], "response_tokens": 9},  # warm-up: not counted
        {"step": 2, "trainer_version": 1, "chunks": [[0, 0, None]], "response_tokens": 2},  # 2 tokens at 1
        {"step": 3, "trainer_version": 2, "chunks": [[0, 2, None]], "response_tokens": 6},  # 6 tokens at 0
        {"step": 3, "trainer_version": 2, "chunks": [], "response_tokens": 3},  # versions unknown
    ]
    figures = tally_records(records, warmup_steps=1).figures()
    assert figures["token_staleness_mean"] == pytest.approx(2 / 8) and figures["head_staleness_mean"] == 0.5
    assert figures["staleness_unknown_trajectories"] == 1.0


def write_jsonl(path, rows) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def test_a_run_reads_our_record_or_verls_and_says_which(tmp_path):
    line = {"step": 2, "trainer_version": 1, "chunks": [[0, 0, None]], "response_tokens": 4}
    assert token_staleness.run_figures(tmp_path, 1) == {}  # neither record: a run from before them
    write_jsonl(tmp_path / token_staleness.VERL_RECORD, [line])
    assert token_staleness.run_figures(tmp_path, 1)["staleness_source"] == token_staleness.VERL_RECORD
    write_jsonl(tmp_path / token_staleness.OURS_RECORD, [line | {"trainer_version": 3}])
    figures = token_staleness.run_figures(tmp_path, 1)
    assert figures["staleness_source"] == "areal_samples.jsonl" and figures["token_staleness_mean"] == 3.0


# ---------------------------------------------------------------- the record of verl's rows


@pytest.fixture
def recorder():
    """:mod:`areal_bench.verl_token_versions`, its patches reverted afterwards (importing it watches verl)."""
    from areal_bench import verl_token_versions

    try:
        yield verl_token_versions
    finally:
        verl_token_versions.revert()


def test_verls_own_resume_loop_records_each_requests_version_and_length(monkeypatch, recorder):
    """verl's ``FullyAsyncLLMServerClient.generate`` runs as shipped over a server stand-in: 3 tokens at version 6,
    cut by an update, then 2 at version 7. verl keeps only min 6 / max 7; the record keeps where each began."""
    import asyncio

    from verl.workers.rollout import llm_server
    from verl.workers.rollout.replica import TokenOutput

    answers = iter([([1, 2, 3], 6, "aborted"), ([4, 5], 7, "stop"), ([8], 7, "stop")])
    seen: list[list[int]] = []

    async def server(self, request_id, *, prompt_ids, sampling_params, **kwargs):
        tokens, version, reason = next(answers)
        seen.append(list(prompt_ids))
        return TokenOutput(
            token_ids=tokens, log_probs=[0.0] * len(tokens), stop_reason=reason, extra_fields={"global_steps": version}
        )

    # verl's method replaced by the stand-in, then wrapped (torn down in reverse: the patch reverted to the
    # stand-in first, then verl's own put back)
    recorder.revert()
    monkeypatch.setattr(llm_server.LLMServerClient, "generate", server)
    no_wait = asyncio.sleep
    monkeypatch.setattr(llm_server.asyncio, "sleep", lambda seconds: no_wait(0))  # verl waits 1 s to resume
    recorder.apply()
    client = llm_server.FullyAsyncLLMServerClient.__new__(llm_server.FullyAsyncLLMServerClient)
    client.config = SimpleNamespace()
    output = asyncio.run(client.generate("r", prompt_ids=[9], sampling_params={"max_tokens": 8}))
    assert output.token_ids == [1, 2, 3, 4, 5] and seen == [[9], [9, 1, 2, 3]]
    assert (output.extra_fields["min_global_steps"], output.extra_fields["max_global_steps"]) == (6, 7)
    assert output.extra_fields["areal_chunks"] == [[0, 6, None], [3, 7, None]]
    # The synchronous client's requests, outside verl's resume loop, record nothing
    alone = asyncio.run(llm_server.LLMServerClient.generate(client, "s", prompt_ids=[9], sampling_params={}))
    assert "areal_chunks" not in alone.extra_fields


def test_the_trained_trajectories_are_recorded_with_the_version_their_update_starts_from(
    recorder, tmp_path, monkeypatch
):
    """Step 4 trains from version 3 (verl's ``trajectory_staleness`` uses global_steps - 1 too). Padding is not a
    trajectory; one without recorded requests whose first and last version agree was generated by that version."""
    monkeypatch.setenv("AREAL_RUN_DIR", str(tmp_path))
    store_calls = []

    def kv_batch_get(keys, partition_id, select_fields):
        store_calls.append((keys, partition_id, select_fields))
        extras = {"a": SimpleNamespace(data={"areal_chunks": [[0, 1, None], [2, 2, None]]}), "b": {}, "c": {}}
        return {"extra_fields": [extras[key] for key in keys]}

    tags = [
        {"response_len": 5, "min_global_steps": 1, "max_global_steps": 2},
        {"response_len": 3, "min_global_steps": 3, "max_global_steps": 3},
        {"response_len": 3, "is_padding": True},
        {"response_len": 4, "min_global_steps": 1, "max_global_steps": 3},
    ]
    batch = SimpleNamespace(keys=["a", "b", "pad", "c"], tags=tags, partition_id="train")
    recorder.record_trained(batch, 4, SimpleNamespace(kv_batch_get=kv_batch_get))
    assert store_calls == [(["a", "b", "c"], "train", ["extra_fields"])]
    lines = [json.loads(line) for line in (tmp_path / token_staleness.VERL_RECORD).read_text().splitlines()]
    assert [(r["key"], r["trainer_version"], r["chunks"], r["response_tokens"]) for r in lines] == [
        ("a", 3, [[0, 1, None], [2, 2, None]], 5),
        ("b", 3, [[0, 3, None]], 3),
        ("c", 3, [], 4),  # versions 1..3, split unknown: counted, left out of the figures
    ]
    figures = tally_records(lines, warmup_steps=1).figures()
    # a: 2 tokens at 2, 3 at 1; b: 3 at 0 -> 7 / 8 per token; heads 2 and 0
    assert figures["token_staleness_mean"] == pytest.approx(7 / 8) and figures["head_staleness_mean"] == 1.0
    assert figures["staleness_unknown_trajectories"] == 1.0


def test_the_record_wraps_verls_very_methods_and_puts_them_back(recorder):
    from verl.trainer.ppo.v1 import trainer_base
    from verl.workers.rollout import llm_server

    recorder.revert()
    originals = (
        llm_server.FullyAsyncLLMServerClient.__dict__["generate"],
        llm_server.LLMServerClient.__dict__["generate"],
        trainer_base.PPOTrainer.__dict__["_compute_metrics"],
    )
    recorder.apply()
    recorder.apply()  # idempotent: wrapped once
    assert recorder.is_applied()
    assert llm_server.LLMServerClient.__dict__["generate"].__wrapped__ is originals[1]
    assert trainer_base.PPOTrainer.__dict__["_compute_metrics"].__wrapped__ is originals[2]
    recorder.revert()
    assert not recorder.is_applied()
    restored = (
        llm_server.FullyAsyncLLMServerClient.__dict__["generate"],
        llm_server.LLMServerClient.__dict__["generate"],
        trainer_base.PPOTrainer.__dict__["_compute_metrics"],
    )
    assert all(now is before for now, before in zip(restored, originals, strict=True))
    with pytest.raises(UnsupportedVerlVersionError, match=r"0\.8\.0"):
        recorder.apply("0.8.0")
    assert not any(patch.is_applied() for patch in recorder.CLIENT_PATCHES + recorder.TRAINER_PATCHES)
