"""Exact-answer reward through math-verify, in verl's ``custom_reward_function`` signature."""

from __future__ import annotations

import logging
from typing import Any

from math_verify import parse, verify

# math-verify warns on every call that its timeouts are off; we know (see compute_score).
for _name in ("math_verify.parser", "math_verify.grader", "math_verify"):
    logging.getLogger(_name).setLevel(logging.ERROR)


def compute_score(
    data_source: str, solution_str: str, ground_truth: str, extra_info: dict[str, Any] | None = None, **kwargs: Any
) -> float:
    """Return 1.0 when math-verify finds ``solution_str``'s answer equal to ``ground_truth``, else 0.0.

    math-verify's own timeouts use ``signal.alarm``, which fails outside a process's main thread
    (verl calls reward functions from threads and async actors), so they are disabled here; the
    reward service (issue 5) bounds time in worker processes instead.
    """
    gold = parse(str(ground_truth), parsing_timeout=None)
    answer = parse(solution_str, parsing_timeout=None)
    if not gold or not answer:
        return 0.0
    return 1.0 if verify(gold, answer, timeout_seconds=None) else 0.0
