"""ffd_allocate against hand-worked examples (Algorithm 1) and its invariants."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from areal_plugins.core.microbatch import ffd_allocate


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


@given(
    lengths=st.lists(st.integers(1, 50), max_size=60),
    capacity=st.integers(50, 200),
    min_groups=st.integers(1, 5),
)
def test_invariants(lengths, capacity, min_groups):
    groups = ffd_allocate(lengths, capacity, min_groups)
    flat = sorted(i for g in groups for i in g)
    assert flat == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in g) <= capacity for g in groups)
    assert len(groups) >= min(min_groups, len(lengths))
