"""Seeds by prompt: what makes η = 0 draw the samples of synchronous verl on any engine that takes a seed."""

from __future__ import annotations

from areal_plugins.rollout.prompt_seeds import PromptSeeds


def test_the_kth_request_for_a_prompt_gets_the_same_seed_whatever_came_between():
    a, b = PromptSeeds(7), PromptSeeds(7)
    first = [a.next([1, 2, 3]) for _ in range(3)]
    b.next([9])  # other prompts in between, in another order
    second = [b.next([1, 2, 3]), b.next([4]), b.next([1, 2, 3]), b.next([1, 2, 3])]
    assert first == [second[0], second[2], second[3]]
    assert len(set(first)) == 3  # a GRPO group's answers are drawn with different seeds


def test_another_run_seed_or_prompt_gives_other_seeds_within_int64():
    seeds = {PromptSeeds(0).next([1, 2, 3]), PromptSeeds(1).next([1, 2, 3]), PromptSeeds(0).next([1, 2, 4])}
    assert len(seeds) == 3
    assert all(0 <= seed < 2**63 for seed in seeds)
