"""A third party's sample buffer, written from docs/guides/plugins.md ("Replace the sample buffer or the
rollout manager") alone: first in, first out, and it trains every group it holds, however old (it counts
those past η). Opt-in: a run loads it only with ``areal.plugins.include: [fifo_buffer]``.

If ``AREAL_FIFO_BUFFER_LOG`` names a file, every take that hands out groups appends a line to it.
"""

from __future__ import annotations

import json
import os
import threading
from collections import deque

import pluggy

AREAL_PLUGIN_OPT_IN = True
hookimpl = pluggy.HookimplMarker("areal_plugins")


class FifoBuffer:
    def __init__(self, max_staleness: int) -> None:
        self.max_staleness = max_staleness
        self.over_stale_kept = 0
        self._groups: deque = deque()
        self._changed = threading.Condition()

    def put(self, group) -> None:
        with self._changed:
            self._groups.append(group)
            self._changed.notify_all()

    def take(self, count, trainer_version, timeout=None):
        with self._changed:
            if not self._changed.wait_for(lambda: len(self._groups) >= count, timeout):
                return [], []
            taken = [self._groups.popleft() for _ in range(count)]
            self.over_stale_kept += sum(g.staleness(trainer_version) > self.max_staleness for g in taken)
        log = os.environ.get("AREAL_FIFO_BUFFER_LOG")
        if log:
            with open(log, "a") as handle:
                handle.write(json.dumps({"version": trainer_version, "groups": [g.group_id for g in taken]}) + "\n")
        return taken, []

    def __len__(self) -> int:
        with self._changed:
            return len(self._groups)


@hookimpl
def areal_make_sample_buffer(config):
    return FifoBuffer(int(config.areal.max_staleness))
