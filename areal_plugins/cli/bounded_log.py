"""The run's ``train.log`` that cannot fill a disk: repeated lines are counted, the file is rotated.

An actor that dies can make another loop on the same error for as long as the run lives (22 MB a
minute was measured before the run stopped itself). Every line is written until its shape (numbers,
addresses and colours blanked) has appeared ``repeats_per_window`` times in the current window; after
that it is counted, and the count is written when the window closes. The file is rotated at
``max_bytes`` (one older copy kept), so a run keeps at most twice that on disk.
"""

from __future__ import annotations

import re
import time
from collections import Counter
from pathlib import Path
from typing import TextIO

_VOLATILE = re.compile(r"\x1b\[[0-9;]*m|0x[0-9a-f]+|\b[0-9a-f]{8,}\b|\d+")


def line_shape(line: str) -> str:
    """The line with what changes between repeats (numbers, addresses, colour codes) blanked."""
    return _VOLATILE.sub("#", line.strip())


class BoundedLog:
    def __init__(
        self,
        path: Path,
        max_bytes: int = 256 * 2**20,
        repeats_per_window: int = 20,
        window_s: float = 60.0,
        clock=time.monotonic,
    ) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self.repeats_per_window = repeats_per_window
        self.window_s = window_s
        self.clock = clock
        self.suppressed_total = 0
        self._seen: Counter[str] = Counter()
        self._suppressed: Counter[str] = Counter()
        self._examples: dict[str, str] = {}
        self._window_start = clock()
        self._file: TextIO = open(path, "a")
        self._size = path.stat().st_size

    def write(self, line: str) -> None:
        if self.clock() - self._window_start >= self.window_s:
            self._close_window()
        shape = line_shape(line)
        self._seen[shape] += 1
        if shape and self._seen[shape] > self.repeats_per_window:
            self._suppressed[shape] += 1
            self._examples.setdefault(shape, line.rstrip()[:200])
            self.suppressed_total += 1
            return
        self._emit(line)

    def _close_window(self) -> None:
        for shape, count in self._suppressed.items():
            self._emit(
                f"[areal-plugins] {count} more lines like this one in {self.window_s:.0f} s were not written: "
                f"{self._examples[shape]}\n"
            )
        self._seen.clear()
        self._suppressed.clear()
        self._examples.clear()
        self._window_start = self.clock()

    def _emit(self, text: str) -> None:
        if self._size + len(text) > self.max_bytes:
            self._file.close()
            self.path.replace(self.path.with_name(self.path.name + ".1"))
            self._file = open(self.path, "a")
            self._size = 0
        self._file.write(text)
        self._size += len(text)

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        self._close_window()
        self._file.close()

    def __enter__(self) -> BoundedLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
