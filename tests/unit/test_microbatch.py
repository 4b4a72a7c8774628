"""ffd_allocate (Algorithm 1) and padded_allocate against hand-worked examples, and their invariants."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from areal_plugins.core.microbatch import ffd_allocate, padded_allocate

#: Random batches and budgets for the invariants of both packings.
budget_cases = given(
    lengths=st.lists(st.integers(1, 50), max_size=60),
    capacity=st.integers(50, 200),
    min_groups=st.integers(1, 5),
)


def test_hand_worked_example():
    # Visit order 8(i2) 5(i0) 3(i1) 2(i3) 2(i4); budget 10.
    # 8 opens G0; 5 has no room in G0 -> G1; 3 fits G1 only; 2(i3) fits G0 (1 seq) and G1 (2 seqs) -> G0;
    # 2(i4): G0 full, G1 has room 2 -> G1.
    assert ffd_allocate([5, 3, 8, 2, 2], capacity=10) == [[2, 3], [0, 1, 4]]


def test_min_groups_opens_groups_first_and_ties_go_to_the_earliest():
    # 8, 5, 3 each open a group (fewer than 3 exist); 2(i3): all fit, all hold one -> earliest G0;
    # 2(i4): G0 is full, G1 and G2 hold one each -> earliest G1.
    assert ffd_allocate([5, 3, 8, 2, 2], capacity=10, min_groups=3) == [[2, 3], [0, 4], [1]]


def test_equal_lengths_visit_lower_index_first():
    assert ffd_allocate([4, 4, 4], capacity=8) == [[0, 1], [2]]


def test_errors_name_the_fix():
    with pytest.raises(ValueError, match="max_tokens to at least 12"):
        ffd_allocate([3, 12], capacity=10)
    with pytest.raises(ValueError, match="capacity must be > 0"):
        ffd_allocate([1], capacity=0)


@budget_cases
def test_invariants(lengths, capacity, min_groups):
    groups = ffd_allocate(lengths, capacity, min_groups)
    flat = sorted(i for g in groups for i in g)
    assert flat == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in g) <= capacity for g in groups)
    assert len(groups) >= min(min_groups, len(lengths))


def test_padded_runs_keep_short_sequences_away_from_long_ones():
    # Budget 40, lengths 30,5,5,5,5,30. FFD (by real tokens): 30(i0) G0, 30(i5) G1, then the 5s alternate
    # between the two by fewest sequences -> [[0, 1, 3], [5, 2, 4]]: padded 3x30 + 3x30 = 180 for 80 real.
    # Padded runs: sorted i0, i5, i1..i4; 40 // 30 = 1 per long run, 40 // 5 = 8 for the last -> padded 80.
    lengths = [30, 5, 5, 5, 5, 30]
    assert ffd_allocate(lengths, capacity=40) == [[0, 1, 3], [5, 2, 4]]
    assert padded_allocate(lengths, capacity=40) == [[0], [5], [1, 2, 3, 4]]


def test_padded_runs_cut_at_the_padded_budget():
    # Sorted: 30(i1) 30(i3) 10(i4) 8(i2) 5(i0) 2(i5); budget 60: 60 // 30 = 2, then 60 // 10 = 6 (4 are left).
    assert padded_allocate([5, 30, 8, 30, 10, 2], capacity=60) == [[1, 3], [4, 2, 0, 5]]
    # 59 // 30 = 1: the second 30 starts its own run; 59 // 30 again; 59 // 10 = 5 takes the rest.
    assert padded_allocate([5, 30, 8, 30, 10, 2], capacity=59) == [[1], [3], [4, 2, 0, 5]]


def test_padded_runs_are_halved_until_min_groups_exist():
    # One run of four (16 // 4); halved into [0, 1] [2, 3]; both pad 8 tokens: the earlier one is halved.
    assert padded_allocate([4, 4, 4, 4], capacity=16, min_groups=3) == [[0], [1], [2, 3]]
    assert padded_allocate([5], capacity=16, min_groups=2) == [[0]]  # nothing left to split
    with pytest.raises(ValueError, match="max_tokens to at least 12"):
        padded_allocate([3, 12], capacity=10)


@budget_cases
def test_padded_runs_invariants(lengths, capacity, min_groups):
    groups = padded_allocate(lengths, capacity, min_groups)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    assert all(len(g) * max(lengths[i] for i in g) <= capacity for g in groups)  # the padded tensor fits
    assert len(groups) >= min(min_groups, len(lengths))
    # Runs of like length: every sequence of a run is at least as short as every one of the run before.
    for before, after in itertools.pairwise(groups):
        assert min(lengths[i] for i in before) >= max(lengths[i] for i in after)


def test_length_order_sorts_each_ranks_mini_batches_and_moves_no_sample_between_them():
    from areal_plugins.core.microbatch import length_ordered

    lengths = [5, 100, 3, 50, 7, 200, 10, 20]  # two ranks of four; mini-batches of two per rank
    assert length_ordered(lengths, ranks=2, mini_batch_per_rank=2) == [1, 0, 3, 2, 5, 4, 7, 6]
    # One mini-batch per rank (or a size that does not divide the share): each rank's share sorted whole.
    assert length_ordered(lengths, ranks=2, mini_batch_per_rank=None) == [1, 3, 0, 2, 5, 7, 6, 4]
    assert length_ordered(lengths, ranks=2, mini_batch_per_rank=3) == [1, 3, 0, 2, 5, 7, 6, 4]
    assert length_ordered([4, 4, 9], ranks=1, mini_batch_per_rank=None) == [2, 0, 1]  # ties keep their order
    with pytest.raises(ValueError, match="do not divide into 3"):
        length_ordered(lengths, ranks=3, mini_batch_per_rank=None)


def test_padded_tokens_pads_each_micro_batch_to_its_longest():
    from areal_plugins.core.microbatch import padded_tokens

    assert padded_tokens([5, 100, 3, 50], 2) == 2 * 100 + 2 * 50
    assert padded_tokens([100, 50, 5, 3], 2) == 2 * 100 + 2 * 5
    assert padded_tokens([4, 1, 2], 2) == 2 * 4 + 1 * 2  # the last micro-batch is short
    with pytest.raises(ValueError, match="micro_batch must be >= 1"):
        padded_tokens([1], 0)


def test_a_verl_batch_is_reordered_by_length_with_its_padding_reported():
    from omegaconf import OmegaConf
    from transfer_queue import KVBatchMeta

    from areal_plugins.driver.length_order import order_batch_by_length, pads_micro_batches

    config = OmegaConf.create(
        {
            "actor_rollout_ref": {
                "model": {"use_remove_padding": False},
                "actor": {"ppo_mini_batch_size": 2},
                "rollout": {"n": 2, "log_prob_micro_batch_size_per_gpu": 2, "log_prob_use_dynamic_bsz": False},
            }
        }
    )
    lengths = [5, 100, 3, 50]
    batch = KVBatchMeta(
        partition_id="train",
        keys=[f"k{i}" for i in range(4)],
        tags=[{"seq_len": n, "i": i} for i, n in enumerate(lengths)],
    )
    metrics: dict = {}
    out = order_batch_by_length(batch, config, dp_size=1, metrics=metrics)
    assert out.keys == ["k1", "k3", "k0", "k2"] and [t["i"] for t in out.tags] == [1, 3, 0, 2]  # tags follow keys
    assert metrics["areal/padded_token_ratio_unordered"] == pytest.approx((2 * 100 + 2 * 50) / 158)
    assert metrics["areal/padded_token_ratio"] == pytest.approx((2 * 100 + 2 * 5) / 158)
    assert pads_micro_batches(config)
    config.actor_rollout_ref.model.use_remove_padding = True
    assert not pads_micro_batches(config)


def test_an_empty_batch_has_an_empty_order():
    from areal_plugins.core.microbatch import length_ordered

    assert length_ordered([], ranks=2, mini_batch_per_rank=None) == []
