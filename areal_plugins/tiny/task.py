"""The CPU task: single-digit addition with exact answers, in verl's RL parquet format.

docs/design.md, The CPU box: a random tiny model never gets the exact answer, so the builder warm-starts it with a
short supervised pass; after that, GRPO with the exact math-verify reward measurably improves it.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from pathlib import Path

from areal_plugins.tiny import cpu_demo_module

DATA_SOURCE = "areal/addition"
#: One token in the tiny tokenizer, repeated as the long-tail workload's "thinking" before the answer.
THINK_TOKEN = " ."


@dataclass(frozen=True)
class AdditionProblem:
    """One problem ``a + b`` with its exact answer."""

    a: int
    b: int

    @property
    def question(self) -> str:
        return f"What is {self.a} + {self.b}?"

    @property
    def answer(self) -> str:
        return str(self.a + self.b)


def make_problems(count: int, seed: int, max_operand: int = 9) -> list[AdditionProblem]:
    """Return ``count`` problems drawn with replacement, deterministic for a given seed."""
    rng = random.Random(seed)
    return [AdditionProblem(rng.randint(0, max_operand), rng.randint(0, max_operand)) for _ in range(count)]


def thinking_lengths(count: int, median: int, sigma: float, cap: int, seed: int) -> list[int]:
    """Lognormal lengths (``median`` tokens, log-space spread ``sigma``) rounded and capped; all 0 if median is 0."""
    if median <= 0:
        return [0] * count
    rng = random.Random(seed)
    return [min(cap, round(median * math.exp(sigma * rng.gauss(0.0, 1.0)))) for _ in range(count)]


def to_verl_row(problem: AdditionProblem, split: str, index: int, data_source: str = DATA_SOURCE) -> dict:
    """Return one row in the layout verl's ``RLHFDataset`` reads (``data_source`` picks the reward rule)."""
    return {
        "data_source": data_source,
        "prompt": [{"role": "user", "content": problem.question}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": problem.answer},
        "extra_info": {"split": split, "index": index},
    }


def write_dataset(
    out_dir: Path, train_size: int, test_size: int, seed: int, max_operand: int = 9, data_source: str = DATA_SOURCE
) -> dict[str, Path]:
    """Write ``train.parquet`` and ``test.parquet`` of sums of operands up to ``max_operand``; return their paths."""
    pd = cpu_demo_module("pandas", "the tiny task's data (parquet files)")
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {}
    for split, size, split_seed in (("train", train_size, seed), ("test", test_size, seed + 1)):
        problems = make_problems(size, split_seed, max_operand=max_operand)
        rows = [to_verl_row(p, split, i, data_source) for i, p in enumerate(problems)]
        path = out_dir / f"{split}.parquet"
        pd.DataFrame(rows).to_parquet(path)
        paths[split] = path
    return paths
