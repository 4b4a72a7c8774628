"""The spread of a measure over repeated runs, as the tools report it: a centre, the range, and how many.

One helper for every tool (``bench.py``, ``bench_control_plane.py``, ``simulate_paper.py``, ``ablation.py``); each
keeps the record shape its committed results in ``docs/results/`` were written with, through ``centre`` and
``count``. Tools run as scripts (``python tools/bench.py``), so their own folder is on ``sys.path`` and they import
this as ``from repeats import spread``; tests load them through ``tests/unit/tool_scripts.py``, which does the same.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from typing import Any

#: How the centre of the values is taken.
CENTRES = {"median": statistics.median, "mean": statistics.mean}


def spread(values: Iterable[float | None], centre: str = "median", count: str | None = "n") -> dict[str, Any]:
    """``{centre: ..., "min": ..., "max": ..., count: how many}`` of ``values``.

    A None value (a repeat that measured nothing) is left out; with no value left every figure is None and the
    count 0.

    Args:
        values: one measure, one value per repeat.
        centre: ``"median"`` (the benchmarks) or ``"mean"`` (the ablation's tables).
        count: the key that says how many values there were (``"n"``; ``"repeats"`` in the control-plane
            bench's records), or None for no count.
    """
    kept = [value for value in values if value is not None]
    if kept:
        row: dict[str, Any] = {centre: CENTRES[centre](kept), "min": min(kept), "max": max(kept)}
    else:
        row = {centre: None, "min": None, "max": None}
    if count is not None:
        row[count] = len(kept)
    return row
