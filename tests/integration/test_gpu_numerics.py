"""What GPU users run, on CPU: bf16 mixed precision and packed sequences (``use_remove_padding: true``).

verl 0.9.1 falls back to pure-torch unpad/pad without flash-attention, transformers builds block-causal
masks from packed position ids, and torch computes bf16 on CPU: η = 0 must still train synchronous verl's
samples to synchronous verl's losses, within what bf16 allows.

Tolerances. Both runs recompute log-probs with the bf16 trainer; synchronous verl's loss uses those alone,
ours also weights each token by w = π_prox/π_behav, where π_behav comes from the engine in fp32. bf16 keeps
8 bits of mantissa (relative precision 2^-8 ≈ 0.4%): the trainer's log-probs differ from the engine's by
~0.005 per token (measured: verl's ``rollout_corr/log_ppl_abs_diff`` 0.0046-0.0054), so w = 1 ± ~0.5% per
token (max 1.025 measured). The loss, a token mean of A·w with group-normalised advantages |A| ≲ 2.5, moves
by about mean|A|·|w - 1| ≈ 1e-3 (measured 1.1e-3 and 7e-5 over two steps): tolerance 5e-3 absolute. The
gradient norm moves by the same relative amount as w (measured 0.6% and 0.3%): tolerance 2%. In fp32 the
same comparison holds to 1e-3 relative (``test_async_trainer.py``).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.conftest import SYNC_STEPS, consumed_by_step, read_jsonl, run_with_dump

pytestmark = pytest.mark.integration

GPU_NUMERICS = (
    "actor_rollout_ref.model.use_remove_padding=true",
    "actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=bf16",
)


@pytest.fixture(scope="module")
def bf16_packed_pair(tiny_dir, distinct_prompts, tmp_path_factory) -> tuple[Path, Path]:
    sync = run_with_dump("grpo_cpu_sync.yaml", tiny_dir, tmp_path_factory, distinct_prompts, *GPU_NUMERICS)
    eta0 = run_with_dump(
        "grpo_cpu_async.yaml", tiny_dir, tmp_path_factory, distinct_prompts, "areal.max_staleness=0", *GPU_NUMERICS
    )
    return sync, eta0


def test_bf16_packed_eta0_consumes_the_samples_of_synchronous_verl(bf16_packed_pair):
    sync, eta0 = bf16_packed_pair
    sync_samples, eta0_samples = consumed_by_step(sync), consumed_by_step(eta0)
    assert sorted(sync_samples) == list(range(1, SYNC_STEPS + 1))
    for step in sync_samples:
        assert eta0_samples[step] == sync_samples[step], f"step {step}: different samples"


def test_bf16_packed_eta0_losses_match_synchronous_verl(bf16_packed_pair):
    sync, eta0 = (read_jsonl(run / "metrics.jsonl") for run in bf16_packed_pair)
    assert len(sync) == len(eta0) == SYNC_STEPS
    for a, b in zip(sync, eta0, strict=True):
        a, b = a["data"], b["data"]
        assert a["critic/score/mean"] == b["critic/score/mean"]
        assert b["actor/pg_loss"] == pytest.approx(a["actor/pg_loss"], abs=5e-3)
        assert b["actor/grad_norm"] == pytest.approx(a["actor/grad_norm"], rel=2e-2)


def test_bf16_noise_alone_keeps_the_behaviour_weights_near_one_and_uncapped(bf16_packed_pair):
    """At η = 0 the only source of w ≠ 1 is arithmetic: in bf16 it stays within a few percent, far from the cap."""
    _, eta0 = bf16_packed_pair
    for row in read_jsonl(eta0 / "metrics.jsonl"):
        data = row["data"]
        assert data["actor/areal/behav_imp_weight_mean"] == pytest.approx(1.0, abs=0.01)
        assert 1.0 < data["actor/areal/behav_imp_weight_max"] < 1.1
        assert data["actor/areal/behav_imp_weight_capped_frac"] == 0.0


def test_packed_batches_are_cut_by_token_budget_first_fit_decreasing(bf16_packed_pair):
    """Packed sequences: the micro-batch budget counts real tokens (FFD), not padded ones (runs of like length)."""
    _, eta0 = bf16_packed_pair
    records = read_jsonl(eta0 / "micro_batches.jsonl")
    assert records
    for record in records:
        assert record["strategy"] == "ffd"
        assert sum(record["sizes"]) == record["sequences"]
        assert all(tokens <= record["capacity"] for tokens in record["tokens"])
