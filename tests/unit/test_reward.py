from __future__ import annotations

import pytest

from areal_plugins.rewards.math_verify_reward import compute_score


@pytest.mark.parametrize(
    ("response", "truth", "expected"),
    [
        ("8", "8", 1.0),
        ("The answer is 8", "8", 1.0),
        ("8.0", "8", 1.0),
        ("\\boxed{12}", "12", 1.0),
        ("9", "8", 0.0),
        ("", "8", 0.0),
        ("eight", "8", 0.0),
    ],
)
def test_exact_answers(response, truth, expected):
    assert compute_score("areal/addition", response, truth) == expected
