"""Exact-answer reward through math-verify, in verl's ``custom_reward_function`` signature."""

from __future__ import annotations

import logging
import re
from typing import Any

from math_verify import parse, verify

# math-verify warns on every call that its timeouts are off; we know (see compute_score).
for _name in ("math_verify.parser", "math_verify.grader", "math_verify"):
    logging.getLogger(_name).setLevel(logging.ERROR)


#: Multi-turn tasks scored on their final turn's bare answer (a whole number alone on the last line):
#: math-verify finds "37+48" equal to 85, so a tool call, or the tool's own answer before an empty final
#: turn, would otherwise earn the reward.
FINAL_LINE_SOURCES = frozenset({"areal/calculator"})


def final_line_answer(solution_str: str) -> str | None:
    """The whole number alone on the response's last line, else None."""
    lines = solution_str.strip().splitlines()
    last = lines[-1].strip() if lines else ""
    return last if re.fullmatch(r"-?\d+", last) else None


def compute_score(
    data_source: str, solution_str: str, ground_truth: str, extra_info: dict[str, Any] | None = None, **kwargs: Any
) -> float:
    """Return 1.0 when math-verify finds ``solution_str``'s answer equal to ``ground_truth``, else 0.0.

    math-verify's own timeouts use ``signal.alarm``, which fails outside a process's main thread
    (verl calls reward functions from threads and async actors), so they are disabled here; the
    reward service (issue 5) bounds time in worker processes instead.
    """
    if data_source in FINAL_LINE_SOURCES:
        answer_text = final_line_answer(solution_str)
        if answer_text is None:
            return 0.0
        solution_str = answer_text
    gold = parse(str(ground_truth), parsing_timeout=None)
    answer = parse(solution_str, parsing_timeout=None)
    if not gold or not answer:
        return 0.0
    return 1.0 if verify(gold, answer, timeout_seconds=None) else 0.0
