"""Sampling seeds by prompt: the same requests draw the same samples whatever batch they share or order they arrive in.

A request's seed is derived from the run's seed, its prompt tokens and how many times this server was asked that
prompt before (the GRPO group's k-th answer gets the k-th seed). Synchronous verl and ``areal_async`` at η = 0 then
sample the same answers, up to differences in the engine's logits between batches.
"""

from __future__ import annotations

import hashlib
from collections import Counter


class PromptSeeds:
    def __init__(self, seed: int) -> None:
        self.seed = seed
        self._asked: Counter[str] = Counter()

    def next(self, prompt_ids: list[int]) -> int:
        """The seed of the next request for ``prompt_ids`` (a non-negative int64)."""
        prompt_key = hashlib.sha256(str(list(prompt_ids)).encode()).hexdigest()
        occurrence = self._asked[prompt_key]
        self._asked[prompt_key] += 1
        digest = hashlib.sha256(f"{self.seed}:{occurrence}:{prompt_key}".encode()).digest()
        return int.from_bytes(digest[:8], "little") & (2**63 - 1)
