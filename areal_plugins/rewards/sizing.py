"""How long one reward may take and how many scoring processes a reward worker runs: pure arithmetic, no Ray.

The reward's limit grows with the answer (a verifier's parse grows with the text it reads): ``areal.reward.timeout_s``
for up to ``areal.reward.timeout_chars`` characters, proportionally more past it. The recipe bounds answers in
tokens (``data.max_response_length``); :data:`CHARS_PER_TOKEN` turns that into characters for what ``check`` and the
startup log print (the limit itself is judged on each answer's own characters).

Scorers: verl 0.9.1 runs ``reward.num_workers`` reward workers (``RewardLoopWorker`` Ray actors, placed round-robin
over the nodes with CPUs; verl's default 8), each calling our ``compute_score`` from its event loop's default thread
pool. Each worker runs its own pool of scoring processes (:class:`~areal_plugins.rewards.service.RewardService`);
unless ``areal.reward.num_workers`` sets it, :func:`scorer_processes` sizes that pool (docs/guides/rewards.md).
"""

from __future__ import annotations

import math

#: Characters of decoded text per generated token, for turning a token bound into the reward's character limit:
#: the common rule of thumb for English BPE vocabularies (OpenAI's "a token is about 4 characters"); the settings'
#: help states the same (a 16k-token answer, about 64k characters). Only what is printed depends on it.
CHARS_PER_TOKEN = 4


def reward_limit_s(timeout_s: float, timeout_chars: int | None, answer_chars: int) -> float:
    """Most seconds one attempt at scoring an answer of ``answer_chars`` characters may take.

    ``timeout_s`` up to ``timeout_chars`` characters, ``timeout_s x answer_chars / timeout_chars`` past it;
    ``timeout_chars`` None: ``timeout_s`` for any length.
    """
    if timeout_chars is None:
        return timeout_s
    return timeout_s * max(1.0, answer_chars / timeout_chars)


def executor_threads(cpus: int) -> int:
    """Threads of Python's default executor (``concurrent.futures.ThreadPoolExecutor()``) on a machine of ``cpus``:
    ``min(32, cpus + 4)``. verl's reward worker runs a synchronous ``compute_score`` there, so no more of its calls are
    in flight at once, and processes beyond that would sit idle."""
    return min(32, cpus + 4)


def scorer_processes(
    answers_per_step: int, reward_workers: int, cpu_nodes: int, cpus_per_node: int, cpu_share: float
) -> int:
    """Scoring processes per verl reward worker, sized to the batch and the nodes' CPUs::

        min( ceil(A / R),                        a worker's share of a step's answers
             floor(C x share / ceil(R / N)),     its share of its node's CPUs for scoring
             min(32, C + 4) )                    the calls verl's thread pool has in flight at once
        and at least 1

    with A = ``data.train_batch_size x actor_rollout_ref.rollout.n`` (answers a step), R = ``reward.num_workers``
    (verl's reward workers), N the nodes with CPUs (verl spreads its workers over them), C the CPUs of the smallest of
    them and share = ``areal.reward.cpu_share`` (the rest is the engines', the trainer's and Ray's). Scoring is CPU
    work (math-verify parses and simplifies), so processes past the CPUs only queue on them.
    """
    if min(answers_per_step, reward_workers, cpu_nodes, cpus_per_node) < 1:
        raise ValueError(
            "scorer_processes needs at least one answer, reward worker, node and CPU, got "
            f"answers_per_step={answers_per_step}, reward_workers={reward_workers}, cpu_nodes={cpu_nodes}, "
            f"cpus_per_node={cpus_per_node}"
        )
    per_worker_answers = math.ceil(answers_per_step / reward_workers)
    workers_per_node = math.ceil(reward_workers / cpu_nodes)
    cpu_bound = math.floor(cpus_per_node * cpu_share / workers_per_node)
    return max(1, min(per_worker_answers, cpu_bound, executor_threads(cpus_per_node)))


def core_share_per_worker(reward_workers: int, cpu_nodes: int, cpu_share: float) -> float:
    """The share of one node's cores that one verl reward worker's scoring processes may take:
    ``cpu_share / ceil(R / N)`` (verl spreads its R reward workers round-robin over the N nodes)."""
    return cpu_share / math.ceil(reward_workers / cpu_nodes)


def capped_by_cores(sized: int, cores: int, core_share: float) -> int:
    """``sized`` scoring processes, at most ``floor(cores x core_share)`` (at least 1).

    The driver sizes from Ray's CPU resource, which a recipe may set above the node's cores (the CPU recipes give
    Ray 16 slots on 2 cores, for verl's per-actor reservations); scoring is CPU work, so the reward worker caps the
    count at the cores its own node has."""
    return max(1, min(sized, math.floor(cores * core_share)))
