"""The test runs' speed knobs: environment variables that slow a part down by a number of seconds (CONTRIBUTING.md).

``AREAL_TEST_ENGINE_STEP_DELAY_S`` (the ``areal_cpu`` engine, per decode step: rollout/cpu/server.py) and
``AREAL_TEST_TRAINER_MICROBATCH_DELAY_S`` (the trainer workers, per micro-batch: trainer_workers/policy_loss.py) are
read here, in the process that slows down. ``tests/unit/test_cli_cluster.py`` finds the variables a worker reads by
scanning for ``os.environ`` reads and for calls of :func:`seconds_from_env`, so a knob read through it is still found.
"""

from __future__ import annotations

import os


def seconds_from_env(variable: str) -> float:
    """``variable`` as seconds (unset or empty: 0); a value that is not a number >= 0 is refused, naming it."""
    raw = os.environ.get(variable, "").strip()
    try:
        delay = float(raw) if raw else 0.0
    except ValueError:
        delay = -1.0
    if not delay >= 0:  # NaN too
        raise ValueError(f"{variable}={raw!r}: set it to a number of seconds >= 0, or unset it")
    return delay
