"""Reward functions that misbehave, importable by spawned worker processes (tests of the reward service)."""

from __future__ import annotations

import os
import time


def well_behaved(data_source, solution, truth, extra):
    return 1.0 if solution.strip() == truth else 0.0


def misbehaving(data_source, solution, truth, extra):
    """``solution`` says how to fail: hang, raise, crash, or answer."""
    if solution == "hang":
        time.sleep(3600)
    if solution == "raise":
        raise ValueError("the verifier cannot parse this")
    if solution == "crash":
        os._exit(7)
    return 1.0 if solution.strip() == truth else 0.0


def crash_once(data_source, solution, truth, extra):
    """Crashes the first time a given marker file is absent, then answers (to show the retry)."""
    marker = extra["marker"]
    if not os.path.exists(marker):
        open(marker, "w").close()
        os._exit(3)
    return 1.0
