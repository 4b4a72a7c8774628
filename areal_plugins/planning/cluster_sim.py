"""An event simulation of synchronous and AReaL-style asynchronous RL on a GPU cluster.

Every inference engine decodes its running sequences in lockstep (continuous batching): between two
events (a sequence finishing, a request arriving, a weight update) all of them gain the same number of
tokens, and each step takes ``Engine.step_base`` + ``step_growth`` per step already taken — exact for
the linear memory-bound step time, so no token-by-token loop is needed.

- **sync**: the step's batch is generated, the step waits for the longest response, then the model
  trains. verl colocates: all GPUs generate, then all train. The paper's synchronous AReaL keeps
  AReaL's disaggregated allocation: ``generating_gpus`` generate while the rest wait, then the rest
  train while the generating GPUs wait.
- **async**: ``rollout_gpus`` generate all the time under the staleness bound (submitted groups ≤
  (η + version + 1)·B); the other GPUs train as soon as B groups are finished. A weight update
  interrupts every engine: it loads the weights and recomputes the KV cache of what it was decoding
  (partial output kept). Without interruption the update waits until the engines drain.
"""

from __future__ import annotations

import heapq
import math
import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from areal_plugins.planning.hardware import (
    GPU,
    Efficiency,
    Engine,
    ModelShape,
    smallest_tensor_parallel,
    train_seconds,
)


@dataclass(frozen=True)
class Workload:
    batch: int = 512  # prompt groups per step
    group: int = 16  # responses per prompt
    response_mean: float = 2100.0
    truncated_fraction: float = 0.005  # responses that would run past max_response
    max_response: int = 27648
    prompt: int = 200
    # A log-normal fitted to a sample of the user's lengths; None: derive it from the mean and the tail.
    log_mu: float | None = None
    log_sigma: float | None = None

    def lognormal(self) -> tuple[float, float]:
        """(μ, σ) of the log-normal with this mean whose tail above ``max_response`` is ``truncated_fraction``:
        ln(max/mean) = σz - σ²/2 with z = Φ⁻¹(1 - fraction); the smaller root."""
        if self.log_mu is not None and self.log_sigma is not None:
            return self.log_mu, self.log_sigma
        z = _inverse_normal(1 - self.truncated_fraction)
        gap = math.log(self.max_response / self.response_mean)
        disc = z * z - 2 * gap
        if disc < 0:
            raise ValueError(
                f"a mean of {self.response_mean:.0f} tokens cannot have {self.truncated_fraction:.2%} of responses "
                f"above {self.max_response}: raise the mean or lower the fraction"
            )
        sigma = z - math.sqrt(disc)
        return math.log(self.response_mean) - sigma * sigma / 2, sigma

    def sample(self, rng: random.Random) -> list[int]:
        mu, sigma = self.lognormal()
        return [draw_length(rng, mu, sigma, self.max_response) for _ in range(self.group)]


def draw_length(rng: random.Random, mu: float, sigma: float, cap: int) -> int:
    """One response length: log-normal(μ, σ) rounded to whole tokens, at least 1, at most ``cap``. The simulator's
    workloads and the bench's GPU-shaped engine stand-in draw with it."""
    return min(cap, max(1, round(rng.lognormvariate(mu, sigma))))


def _inverse_normal(p: float) -> float:
    from statistics import NormalDist

    return NormalDist().inv_cdf(p)


@dataclass(frozen=True)
class Cluster:
    gpu: GPU
    model: ModelShape
    efficiency: Efficiency
    gpus: int
    rollout_gpus: int = 0  # async only; the rest train
    kv_capacity_tokens: float | None = None  # each engine's KV cache; None: what its memory holds

    def engine(self) -> Engine:
        tp = smallest_tensor_parallel(self.gpu, self.model)
        return Engine(self.gpu, self.model, self.efficiency, tensor_parallel=tp,
                      kv_capacity_override=self.kv_capacity_tokens)  # fmt: skip


@dataclass
class _Sequence:
    group: int
    prompt: int
    length: int
    finish_at: float = 0.0  # the engine's step count at which it is done


class _EngineState:
    """One engine's running sequences, advanced lazily to the time of the next event."""

    def __init__(self, engine: Engine, expected_tokens: float, weight_load_s: float | None = None) -> None:
        self.engine = engine
        #: an update's pause to load weights (default: the engine's; a stand-in that loads none: 0)
        self.weight_load_s = engine.weight_load_time() if weight_load_s is None else weight_load_s
        self.capacity_tokens = engine.kv_capacity_tokens
        #: sequences of the mean length the cache holds: the default concurrency of the submitter, not a bound on
        #: what runs (:meth:`DecodeCost.kv_admits` bounds that by tokens)
        self.max_running = max(1, int(self.capacity_tokens // expected_tokens))
        self.reserved = 0.0  # KV tokens the running sequences hold once done (prompt + response)
        self.steps = 0.0  # decode steps done since the start
        self.clock = 0.0
        self.busy_until = 0.0  # prefill or weight load: no decoding until then
        self.context = 0.0  # KV tokens held by the running sequences
        self.finishing: list[tuple[float, int, _Sequence]] = []
        self.queue: deque[_Sequence] = deque()
        self.epoch = 0  # bumped whenever the next finish time changes
        self.decoded = 0.0

    @property
    def running(self) -> int:
        return len(self.finishing)

    @property
    def load(self) -> int:
        return self.running + len(self.queue)

    def advance(self, now: float) -> None:
        start = max(self.clock, self.busy_until)
        if now > start and self.running:
            steps = self.engine.steps_in(self.running, self.context, now - start)
            self.steps += steps
            self.context += steps * self.running
            self.decoded += steps * self.running
        self.clock = max(self.clock, now)

    def next_finish(self) -> float:
        if not self.finishing:
            return math.inf
        steps = max(0.0, self.finishing[0][0] - self.steps)
        start = max(self.clock, self.busy_until)
        return start + self.engine.time_for_steps(self.running, self.context, steps)

    def admit(self, now: float) -> None:
        """Start queued sequences while their KV cache fits (first come, first served), then prefill their prompts:
        Σ prompt tokens through the matmuls and Σ prompt² through attention (:meth:`DecodeCost.prefill_s`)."""
        prompts = squared = 0
        fits = self.engine.decode.kv_admits
        while self.queue and fits(self.running, self.reserved, self.queue[0].prompt + self.queue[0].length,
                                  self.capacity_tokens):  # fmt: skip
            seq = self.queue.popleft()
            seq.finish_at = self.steps + seq.length
            heapq.heappush(self.finishing, (seq.finish_at, id(seq), seq))
            self.context += seq.prompt
            self.reserved += seq.prompt + seq.length
            prompts += seq.prompt
            squared += seq.prompt * seq.prompt
        if prompts:
            self.busy_until = max(self.busy_until, now) + self.engine.prefill_time(prompts, squared)
        self.epoch += 1

    def pop_finished(self, now: float) -> list[_Sequence]:
        done = []
        while self.finishing and self.finishing[0][0] <= self.steps + 1e-3:
            _, _, seq = heapq.heappop(self.finishing)
            self.context -= seq.prompt + seq.length
            self.reserved -= seq.prompt + seq.length
            done.append(seq)
        self.context = max(self.context, 0.0)
        if done:
            self.admit(now)
        return done

    def interrupt(self, now: float) -> None:
        """Load new weights, then recompute the KV cache of every running sequence (partial output kept)."""
        self.advance(now)
        squared = sum((s.prompt + s.length - (s.finish_at - self.steps)) ** 2 for _, _, s in self.finishing)
        pause = self.weight_load_s + self.engine.prefill_time(self.context, squared)
        self.busy_until = max(self.busy_until, now) + pause
        self.epoch += 1


@dataclass
class Result:
    step_ends: list[float]
    step_tokens: list[int]
    staleness: list[int] = field(default_factory=list)
    decoded_tokens: float = 0.0
    sampled_tokens_per_step: float = 0.0  # the mean over every group drawn, trained or still in flight
    #: simulate_sync only: each step's generation (its longest response) and training seconds
    generate_s: list[float] = field(default_factory=list)
    train_s: list[float] = field(default_factory=list)

    def step_s(self, warmup: int) -> float:
        """Mean step time after the first ``warmup`` steps (the pipeline fills meanwhile)."""
        start = self.step_ends[warmup - 1] if warmup else 0.0
        return (self.step_ends[-1] - start) / (len(self.step_ends) - warmup)

    def tokens_per_s(self, warmup: int) -> float:
        """Trained tokens per second in steady state: a step's expected tokens over the mean step time.
        (The tokens of the steps themselves are biased in a short run: short groups finish, and are
        trained, first.)"""
        return self.sampled_tokens_per_step / self.step_s(warmup)


def _group_tokens(lengths: list[int], prompt: int) -> list[float]:
    return [float(prompt + n) for n in lengths]


#: Seconds to train one step given its sequences' tokens (prompt + response each).
TrainTime = Callable[[list[float]], float]


def simulate_sync(
    cluster: Cluster,
    work: Workload,
    steps: int,
    seed: int = 0,
    generating_gpus: int | None = None,
    train_time: TrainTime | None = None,
    weight_load_s: float | None = None,
) -> Result:
    """Generate, then train. ``generating_gpus``: None colocates (every GPU does both, as verl does);
    a count gives generation that many GPUs and training the rest, one after the other (synchronous AReaL).
    ``train_time``: a step's training seconds (default: the cluster's model on its training GPUs,
    :func:`~areal_plugins.planning.hardware.train_seconds`); ``weight_load_s``: the engines' pause to load an
    update's weights (default: the engine's :meth:`~areal_plugins.planning.hardware.Engine.weight_load_time`) —
    both given where a system's trainer was measured rather than modelled (the bench's stand-in)."""
    rng = random.Random(seed)
    engine = cluster.engine()
    load_s = engine.weight_load_time() if weight_load_s is None else weight_load_s
    if generating_gpus is None:
        generating_gpus = train_gpus = cluster.gpus
    else:
        train_gpus = cluster.gpus - generating_gpus
        if generating_gpus < engine.tensor_parallel or train_gpus < 1:
            raise ValueError(f"{cluster.gpus} GPUs cannot split into {generating_gpus} generating + the rest training")
    engines = [
        _EngineState(engine, work.prompt + work.response_mean) for _ in range(generating_gpus // engine.tensor_parallel)
    ]
    clock = 0.0
    ends, tokens, generate_s, train_s = [], [], [], []
    for _ in range(steps):
        lengths = []
        for group in range(work.batch):
            sample = work.sample(rng)
            target = min(engines, key=lambda e: e.load)
            target.queue.extend(_Sequence(group, work.prompt, n) for n in sample)
            lengths += sample
        for state in engines:
            state.clock = state.busy_until = clock
            state.admit(clock)
        gen_end = clock
        for state in engines:
            while state.running:
                now = state.next_finish()
                state.advance(now)
                state.pop_finished(now)
                gen_end = max(gen_end, now)
        lengths_with_prompt = _group_tokens(lengths, work.prompt)
        if train_time is None:
            train = train_seconds(cluster.model, cluster.gpu, cluster.efficiency, train_gpus, lengths_with_prompt)
        else:
            train = train_time(lengths_with_prompt)
        generate_s.append(gen_end - clock)
        train_s.append(train)
        clock = gen_end + train + load_s
        ends.append(clock)
        tokens.append(int(sum(lengths_with_prompt)))
    return Result(
        ends, tokens, sampled_tokens_per_step=sum(tokens) / len(tokens), generate_s=generate_s, train_s=train_s
    )


def simulate_async(
    cluster: Cluster,
    work: Workload,
    eta: float,
    steps: int,
    seed: int = 0,
    interruptible: bool = True,
    max_concurrent_groups: int | None = None,
    train_time: TrainTime | None = None,
    weight_load_s: float | None = None,
    colocated: bool = False,
) -> Result:
    """AReaL's pipeline; ``eta`` = math.inf for no staleness bound. ``train_time``, ``weight_load_s``: as
    :func:`simulate_sync`'s. ``colocated``: every GPU both generates and trains (``rollout_gpus`` ignored): the
    engines stop while the trainer computes, and the update wakes them (weights loaded, KV caches recomputed)."""
    rng = random.Random(seed)
    engine = cluster.engine()
    generating = cluster.gpus if colocated else cluster.rollout_gpus
    train_gpus = cluster.gpus if colocated else cluster.gpus - cluster.rollout_gpus
    if generating < engine.tensor_parallel or train_gpus < 1:
        raise ValueError(f"{cluster.gpus} GPUs cannot split into {cluster.rollout_gpus} generating + the rest training")
    engines = [
        _EngineState(engine, work.prompt + work.response_mean, weight_load_s)
        for _ in range(generating // engine.tensor_parallel)
    ]
    # AReaL's max_concurrent_rollouts; by default what the engines' KV caches hold plus one group each
    # waiting, so that an unbounded η does not queue the whole dataset.
    room = sum(state.max_running for state in engines) // work.group + len(engines)
    concurrency = room if max_concurrent_groups is None else max_concurrent_groups
    events: list[tuple[float, int, int, int]] = []  # (time, engine index, epoch, tie-break)
    counter = 0

    def schedule(index: int) -> None:
        nonlocal counter
        state = engines[index]
        when = state.next_finish()
        if when < math.inf:
            counter += 1
            heapq.heappush(events, (when, index, state.epoch, counter))

    version = 0  # the trainer's
    submitted = 0
    in_flight = 0
    group_left: dict[int, int] = {}
    group_tokens: dict[int, float] = {}
    group_version: dict[int, int] = {}
    finished: deque[int] = deque()
    trainer_free_at = 0.0
    training = False
    update_pending = False  # non-interruptible: the trainer's new weights wait for the engines to drain
    rollout_version = 0
    ends: list[float] = []
    tokens: list[int] = []
    staleness: list[int] = []
    now = 0.0

    def submit(now: float) -> None:
        nonlocal submitted, in_flight
        if update_pending:
            return
        limit = (eta + version + 1) * work.batch
        while submitted < limit and in_flight < concurrency:
            lengths = work.sample(rng)
            index = min(range(len(engines)), key=lambda i: engines[i].load)
            state = engines[index]
            state.advance(now)
            gid = submitted
            state.queue.extend(_Sequence(gid, work.prompt, n) for n in lengths)
            group_left[gid] = len(lengths)
            group_tokens[gid] = sum(_group_tokens(lengths, work.prompt))
            group_version[gid] = rollout_version
            submitted += 1
            in_flight += 1
            state.admit(now)
            schedule(index)

    def start_training(now: float) -> None:
        nonlocal training, trainer_free_at
        if training or len(finished) < work.batch:
            return
        batch = [finished.popleft() for _ in range(work.batch)]
        lengths = [group_tokens[g] / work.group for g in batch for _ in range(work.group)]
        if train_time is None:
            seconds = train_seconds(cluster.model, cluster.gpu, cluster.efficiency, train_gpus, lengths)
        else:
            seconds = train_time(lengths)
        trainer_free_at = max(now, trainer_free_at) + seconds
        staleness.extend(version - group_version[g] for g in batch)
        tokens.append(int(sum(group_tokens[g] for g in batch)))
        training = True
        if colocated:  # the engines sleep while the trainer has the GPUs (decoded tokens kept)
            for index, state in enumerate(engines):
                state.advance(now)
                state.busy_until = max(state.busy_until, trainer_free_at)
                state.epoch += 1
                schedule(index)

    submit(0.0)
    while len(ends) < steps:
        next_event = events[0][0] if events else math.inf
        if training and trainer_free_at <= next_event:
            now = trainer_free_at
            training = False
            version += 1
            ends.append(now)
            if interruptible:
                rollout_version = version
                for index, state in enumerate(engines):
                    state.interrupt(now)
                    schedule(index)
            else:
                update_pending = True
            if update_pending and all(state.load == 0 for state in engines):
                _apply_drained_update(engines, now)
                update_pending, rollout_version = False, version
            submit(now)
            start_training(now)
            continue
        if not events:
            raise RuntimeError("the simulated pipeline stalled: no engine has work and the trainer waits")
        now, index, epoch, _ = heapq.heappop(events)
        state = engines[index]
        if epoch != state.epoch:
            continue
        state.advance(now)
        for seq in state.pop_finished(now):
            group_left[seq.group] -= 1
            if group_left[seq.group] == 0:
                in_flight -= 1
                finished.append(seq.group)
        schedule(index)
        if update_pending and all(s.load == 0 for s in engines):
            _apply_drained_update(engines, now)
            update_pending, rollout_version = False, version
        submit(now)
        start_training(now)
    decoded = sum(state.decoded for state in engines)
    per_step = sum(group_tokens.values()) / len(group_tokens) * work.batch
    return Result(ends, tokens, staleness, decoded_tokens=decoded, sampled_tokens_per_step=per_step)


def _apply_drained_update(engines: list[_EngineState], now: float) -> None:
    for state in engines:
        state.clock = max(state.clock, now)
        state.busy_until = max(state.busy_until, now) + state.weight_load_s
        state.epoch += 1
