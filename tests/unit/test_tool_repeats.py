"""The one spread helper of the tools (tools/repeats.py): figures derived by hand; no tool keeps a copy."""

from __future__ import annotations

import ast

import pytest

from tests.unit.tool_scripts import TOOLS, load_tool

repeats = load_tool("repeats")


def test_the_median_and_range_over_the_repeats_that_measured():
    # 3, 1, 2 measured (None: a repeat that measured nothing): sorted 1, 2, 3 -> median 2, range 1-3, 3 values.
    assert repeats.spread([3.0, None, 1.0, 2.0]) == {"median": 2.0, "min": 1.0, "max": 3.0, "n": 3}
    assert repeats.spread([3.0, None, 1.0, 2.0], count="repeats")["repeats"] == 3
    assert repeats.spread([None]) == {"median": None, "min": None, "max": None, "n": 0}


def test_the_mean_for_the_ablations_tables_without_a_count():
    # 1 + 2 + 6 = 9 over 3 -> mean 3 (the median would be 2).
    assert repeats.spread([1.0, 2.0, 6.0], centre="mean", count=None) == {"mean": 3.0, "min": 1.0, "max": 6.0}
    with pytest.raises(KeyError):
        repeats.spread([1.0], centre="mode")


def test_no_tool_defines_a_spread_of_its_own():
    copies = [
        path.name
        for path in sorted(TOOLS.glob("*.py"))
        if path.name != "repeats.py"
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.FunctionDef) and node.name == "spread"
    ]
    assert not copies, f"use tools/repeats.py's spread instead of a copy in {copies}"
