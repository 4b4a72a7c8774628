"""verl's synchronous replay buffer with a configurable poll interval, for a fair synchronous baseline.

verl 0.9.1's ``ReplayBuffer`` looks for finished rollouts every 2 s and the interval is not a config key,
so a synchronous step's generation phase ends on a 2 s tick (``timing_s/gen`` = 4.03, 6.05, 8.05 s ...):
up to 2 s of idle per step, ~1 s on average, that our async trainer (polling every
``areal.poll_interval_s`` = 0.05 s) does not pay. ``python tools/bench.py`` gives the synchronous baseline
this class through verl's own seam, ``trainer.v1.sampler.custom_sampler``, with
``trainer.v1.sampler.sampler_kwargs.poll_interval_s``; nothing else changes.
"""

from __future__ import annotations

from typing import Any

from verl.trainer.ppo.v1.replay_buffer import ReplayBuffer

DEFAULT_POLL_INTERVAL_S = 0.05


class PollingReplayBuffer(ReplayBuffer):
    """``ReplayBuffer`` polling every ``sampler_kwargs.poll_interval_s`` seconds (default 0.05)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        sampler_kwargs = kwargs.get("sampler_kwargs") or {}
        kwargs.setdefault("poll_interval", float(sampler_kwargs.get("poll_interval_s", DEFAULT_POLL_INTERVAL_S)))
        super().__init__(*args, **kwargs)
