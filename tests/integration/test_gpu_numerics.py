"""What GPU users run, on CPU: bf16 mixed precision and packed sequences (``use_remove_padding: true``).

verl 0.9.1 falls back to pure-torch unpad/pad without flash-attention, transformers builds block-causal
masks from packed position ids, and torch computes bf16 on CPU: η = 0 must still train synchronous verl's
samples to synchronous verl's losses, within what bf16 allows. The pair is the multi-turn one (``tool_runs``
in conftest.py: verl's tool_agent loop, calculator tool), so packing also meets masked tool observations.

Tolerances. Both runs recompute log-probs with the bf16 trainer; synchronous verl's loss uses those alone,
ours also weights each token by w = π_prox/π_behav, where π_behav comes from the engine in fp32. bf16 keeps
8 bits of mantissa (relative precision 2^-8 ≈ 0.4%): the trainer's log-probs differ from the engine's by
~0.005 per token (docs/results/bf16.md), so w = 1 ± ~0.5% per token (max measured: 1.03 single-turn, 1.08
with this pair's longer multi-turn responses). The loss, a token mean of A·w with group-normalised
advantages |A| ≲ 2.5, moves by about mean|A|·|w - 1| ≈ 1e-3: tolerance 5e-3 absolute.

The gradient norm has no such bound: the gradient is a sum in which advantages of both signs cancel, so a
0.5% change per term can move its norm by more. Step 1 trains the same weights in both runs: measured 0.3%
and 0.6% (single-turn, an AVX-512 machine), 2.1% (single-turn, another one: bf16 kernels differ by CPU
instruction set), 1.9% (this pair) and 5.3% (this pair, an AVX2-only machine). From step 2 on the runs train
slightly different weights (Adam's first update is ~lr·sign(g), which flips wherever bf16 noise decides a sign):
measured 3.4% and 0.6% (this pair). Tolerance 15%: it still catches a loss scaled by a wrong count (x2 for two
micro-batches). The different weights can also flip a sampled token from step 2 on (conftest.py,
``assert_bf16_pair_trains_the_same_samples``); the score and loss bounds widen by the share of samples that
differ. In fp32 the same comparison holds to 1e-3 relative (``test_async_trainer.py``).
"""

from __future__ import annotations

import pytest

from tests.integration.conftest import SYNC_STEPS, assert_bf16_pair_trains_the_same_samples, read_jsonl

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def bf16_packed_pair(tool_runs):
    sync, eta0, _ = tool_runs
    return sync, eta0


def test_bf16_packed_eta0_consumes_the_samples_of_synchronous_verl(bf16_packed_pair):
    assert_bf16_pair_trains_the_same_samples(*bf16_packed_pair)


def test_bf16_packed_eta0_losses_match_synchronous_verl(bf16_packed_pair):
    differing = assert_bf16_pair_trains_the_same_samples(*bf16_packed_pair)
    sync, eta0 = (read_jsonl(run / "metrics.jsonl") for run in bf16_packed_pair)
    assert len(sync) == len(eta0) == SYNC_STEPS
    for a, b in zip(sync, eta0, strict=True):
        a, b = a["data"], b["data"]
        step = a["training/global_step"]
        # A sample trained by one run only moves the mean score by at most its share times the reward's range,
        # and the loss by about its share of the tokens times |A| (up to 3x the mean length).
        scores = (a["critic/score/max"], b["critic/score/max"], a["critic/score/min"], b["critic/score/min"])
        reward_range = max(scores) - min(scores)
        advantage = max(abs(a["critic/advantages/max"]), abs(a["critic/advantages/min"]))
        assert abs(a["critic/score/mean"] - b["critic/score/mean"]) <= differing[step] * reward_range + 1e-9
        assert b["actor/pg_loss"] == pytest.approx(a["actor/pg_loss"], abs=5e-3 + 3 * advantage * differing[step])
        assert b["actor/grad_norm"] == pytest.approx(a["actor/grad_norm"], rel=0.15)


def test_bf16_noise_alone_keeps_the_behaviour_weights_near_one_and_uncapped(bf16_packed_pair):
    """At η = 0 the only source of w ≠ 1 is arithmetic: in bf16 it stays within a few percent, far from the cap."""
    _, eta0 = bf16_packed_pair
    for row in read_jsonl(eta0 / "metrics.jsonl"):
        data = row["data"]
        assert data["actor/areal/behav_imp_weight_mean"] == pytest.approx(1.0, abs=0.01)
        assert 1.0 < data["actor/areal/behav_imp_weight_max"] < 1.25  # the cap is 5
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
