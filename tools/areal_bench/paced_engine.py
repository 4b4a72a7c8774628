"""A rollout engine stand-in with no model: it returns tokens at a fixed rate, as a GPU engine's decode would.

:class:`PacedRolloutServer` keeps the rollout server contract (:mod:`areal_plugins.rollout.base`): our gate, abort
with partial output, resume, per-token versions, ``update_weights`` and ``get_stats`` are the base class's or
kept as a real engine keeps them; only the model is gone. A request of ``max_tokens`` tokens takes
``max_tokens / tokens_per_s`` seconds, whatever else is in flight (a GPU engine decodes its batch in parallel);
an abort ends it at once with the tokens "decoded" so far. Many thousands of requests in flight cost one timer
each, so the cores of a small machine measure the control plane (admission, buffer, client, control calls), not a
model. ``tools/bench_control_plane.py`` drives it; it also serves tests that need an engine with timing but no
weights.

:class:`VerlPacedServer` is the same engine as ``actor_rollout_ref.rollout.name=areal_paced``: built by our verl
replica like ``areal_cpu``, so that verl's own trainers (sync, ``colocate_async``, ``separate_async``) and ours drive
the same stand-in in ``python tools/bench.py --workload paced``. It holds no weights, so it declares neither
``weight_update`` nor ``weight_checksum``: ``areal_async`` refuses it unless a recipe waives both by name.

:class:`GpuShapedDecode` paces it as a GPU engine of a planner's case decodes instead
(``engine_kwargs.areal_paced.case``, ``python tools/bench.py --workload gpu-shaped``): the running answers advance in
lockstep, each step costing what the planner's :class:`~areal_plugins.planning.hardware.DecodeCost` says for them
and their cached tokens; the KV cache bounds what runs (the rest queue); every answer's length is drawn from the
case's log-normal scaled down; a request that continues after an abort prefills its prompt and partial output again.
It sleeps between events (an answer finishing, a request arriving, an abort) and does no work per token, so the
trainer has the cores to itself.

Two differences from a real server, both for the cost of starting many of them on a small machine: its
:meth:`~areal_plugins.rollout.base.RolloutServer._token_output` returns :class:`PacedOutput`, which has the fields of
verl's ``TokenOutput`` (our client and verl's read only those), so that an engine process never imports verl (10 s of
CPU and 580 MB each); and the first arrival of each prompt (``prompt_ids[0]``, the bench's group index) is stamped, for
:meth:`PacedRolloutServer.take_arrivals`.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from areal_plugins.rollout.base import Generated, RolloutServer
from areal_plugins.weight_sync.errors import WeightSyncError

if TYPE_CHECKING:
    from areal_plugins.planning.hardware import DecodeCost


@dataclass
class PacedOutput:
    """What one request returns: the fields of verl's ``TokenOutput``, without importing verl."""

    token_ids: list[int]
    log_probs: list[float] | None = None
    routed_experts: Any = None
    stop_reason: str | None = None
    num_preempted: int | None = None
    extra_fields: dict[str, Any] = field(default_factory=dict)


class _Busy:
    """Seconds on the loop's clock during which at least one request was in the engine."""

    def __init__(self) -> None:
        self.total = 0.0
        self.since: float | None = None

    def update(self, in_flight: int, now: float) -> None:
        if in_flight and self.since is None:
            self.since = now
        elif not in_flight and self.since is not None:
            self.total += now - self.since
            self.since = None

    def seconds(self, now: float) -> float:
        return self.total + (now - self.since if self.since is not None else 0.0)


class FixedRate:
    """Every request decodes ``tokens_per_s`` tokens per second to its ``max_tokens``, whatever else runs.

    A pacer (:class:`PacedRolloutServer` asks one): ``run`` returns (tokens produced, whether aborted).
    """

    def __init__(self, tokens_per_s: float) -> None:
        if not tokens_per_s > 0:
            raise ValueError(f"tokens_per_s must be > 0, got {tokens_per_s!r}")
        self.tokens_per_s = float(tokens_per_s)
        # request id -> (its future: True when aborted, its timer, start time on the loop's clock)
        self._running: dict[str, tuple[asyncio.Future[bool], asyncio.TimerHandle, float]] = {}
        self.busy = _Busy()

    @property
    def in_flight(self) -> int:
        return len(self._running)

    def length(self, request_id: str, max_tokens: int) -> int:
        """Tokens this request asks of the engine: all it may have."""
        return max_tokens

    async def run(self, request_id: str, prompt_tokens: int, tokens: int) -> tuple[int, bool]:
        loop = asyncio.get_running_loop()
        done: asyncio.Future[bool] = loop.create_future()
        started = loop.time()
        timer = loop.call_later(tokens / self.tokens_per_s, _settle, done, False)
        self._running[request_id] = (done, timer, started)
        self.busy.update(len(self._running), started)
        try:
            aborted = await done
        finally:
            self._running.pop(request_id, None)
            self.busy.update(len(self._running), loop.time())
        count = min(tokens, int((loop.time() - started) * self.tokens_per_s)) if aborted else tokens
        return count, aborted

    def abort(self, request_id: str) -> bool:
        entry = self._running.get(request_id)
        if entry is not None:
            entry[1].cancel()
            _settle(entry[0], True)
        return entry is not None

    def abort_all(self) -> list[str]:
        request_ids = list(self._running)
        for request_id in request_ids:
            self.abort(request_id)
        return request_ids


@dataclass
class _Request:
    future: asyncio.Future[tuple[int, bool]]
    prompt: int  # tokens to prefill: the prompt, and on a continuation the partial output before it
    tokens: int  # tokens to decode
    start_step: float = 0.0  # the engine's step count when it joined the running batch

    @property
    def reserve(self) -> int:
        """KV cache tokens it holds once done: admitted only where they fit."""
        return self.prompt + self.tokens


#: Aborted requests remembered for their continuation (their drawn length and what they produced), oldest dropped.
REMEMBERED_REQUESTS = 1 << 16
#: A finish within this many decode steps of due counts as due (the loop's timers fire to the clock's resolution).
STEP_TOLERANCE = 1e-3


class GpuShapedDecode:
    """A pacer that decodes as one of a GPU case's engines does (continuous batching, in lockstep).

    Between two events (a request finishing, arriving or aborted) every running request gains the same number of
    tokens, and ``steps`` steps take ``time_scale`` x ``cost.time_for_steps(running, cached tokens, steps)``
    seconds: the planner's decode model (:mod:`areal_plugins.planning.hardware`), slowed by ``time_scale``.
    Admitting requests pauses decoding for ``time_scale`` x ``cost.prefill_s`` of their prompts (as the planner's
    engine does); a request is admitted while the KV cache it will hold when done (prompt + answer) fits beside the
    running ones' (first come, first served; one request always runs), so nothing is ever preempted.

    Each new request's answer length is drawn from log-normal(``log_mu``, ``log_sigma``) (rounded, at least 1, at
    most its ``max_tokens``: :func:`~areal_plugins.planning.cluster_sim.draw_length`) by a generator seeded with
    ``seed``; an aborted one is remembered by its id, so that its continuation (verl's client re-sends the prompt
    and the partial output under the same id, to the same replica) decodes the rest of the same answer, after
    prefilling everything it re-sends. Nothing is done per token: one timer per event.

    Args:
        cost: the case engine's decode and prefill times.
        kv_capacity_tokens: KV cache tokens the engine holds.
        time_scale: seconds here per second of the case's GPU time.
        log_mu: μ of the answers' log-normal length (tokens).
        log_sigma: σ of it.
        seed: the length generator's seed.
    """

    def __init__(
        self,
        cost: DecodeCost,
        kv_capacity_tokens: float,
        time_scale: float,
        log_mu: float,
        log_sigma: float,
        seed: int = 0,
    ) -> None:
        if not time_scale > 0:
            raise ValueError(f"time_scale must be > 0, got {time_scale!r}")
        if not kv_capacity_tokens >= 1:
            raise ValueError(f"kv_capacity_tokens must be at least 1, got {kv_capacity_tokens!r}")
        self.cost = cost
        self.kv_capacity_tokens = float(kv_capacity_tokens)
        self.time_scale = float(time_scale)
        self.log_mu, self.log_sigma = float(log_mu), float(log_sigma)
        self._rng = random.Random(seed)
        self.steps = 0.0  # decode steps done since the start (fractional between events)
        self.context = 0.0  # KV cache tokens of the running requests
        self.reserved = 0  # KV cache tokens they will hold when done
        self._clock = 0.0  # loop time up to which ``steps`` is advanced
        self._busy_until = 0.0  # loop time a prefill ends: no decoding before
        self.running: dict[str, _Request] = {}
        self.queue: OrderedDict[str, _Request] = OrderedDict()
        self._remembered: OrderedDict[str, int] = OrderedDict()  # an aborted request's id -> tokens still due
        self._wake: asyncio.Event | None = None
        self._pump: asyncio.Task[None] | None = None
        self.busy = _Busy()
        self.wakeups = 0  # turns of the batch loop: one per event, never one per token

    @property
    def in_flight(self) -> int:
        return len(self.running) + len(self.queue)

    # ------------------------------------------------------------------ lengths

    def draw(self, cap: int) -> int:
        """One answer length (tokens) of the case's distribution, at most ``cap``."""
        from areal_plugins.planning.cluster_sim import draw_length

        return draw_length(self._rng, self.log_mu, self.log_sigma, cap)

    def length(self, request_id: str, max_tokens: int) -> int:
        """Tokens this request decodes: a new answer's drawn length, or the rest of an aborted one's."""
        due = self._remembered.pop(request_id, None)
        return min(max_tokens, self.draw(max_tokens) if due is None else due)

    # ------------------------------------------------------------------ requests

    async def run(self, request_id: str, prompt_tokens: int, tokens: int) -> tuple[int, bool]:
        if tokens <= 0:
            return 0, False
        if request_id in self.running or request_id in self.queue:
            raise ValueError(f"request {request_id!r} is already in the engine: one generation per id at a time")
        loop = asyncio.get_running_loop()
        request = _Request(loop.create_future(), prompt_tokens, tokens)
        self._advance(loop.time())
        self.queue[request_id] = request
        self.busy.update(self.in_flight, loop.time())
        self._kick(loop)
        try:
            produced, aborted = await request.future
        except asyncio.CancelledError:
            self.abort(request_id)
            raise
        if aborted:  # its continuation decodes the rest of the same answer
            self._remembered[request_id] = tokens - produced
            while len(self._remembered) > REMEMBERED_REQUESTS:
                self._remembered.popitem(last=False)
        return produced, aborted

    def abort(self, request_id: str) -> bool:
        """End one request now with the tokens decoded so far (none while queued or prefilling)."""
        loop = asyncio.get_running_loop()
        self._advance(loop.time())
        request = self.queue.pop(request_id, None)
        produced = 0
        if request is None:
            request = self.running.pop(request_id, None)
            if request is None:
                return False
            done_steps = min(float(request.tokens), self.steps - request.start_step)
            produced = min(request.tokens, math.floor(done_steps + STEP_TOLERANCE))
            self.context = max(0.0, self.context - request.prompt - done_steps)
            self.reserved -= request.reserve
        if not request.future.done():
            request.future.set_result((produced, True))
        self.busy.update(self.in_flight, loop.time())
        self._kick(loop)
        return True

    def abort_all(self) -> list[str]:
        request_ids = [*self.running, *self.queue]
        for request_id in request_ids:
            self.abort(request_id)
        return request_ids

    # ------------------------------------------------------------------ the batch

    def _kick(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._wake is None:
            self._wake = asyncio.Event()
        self._wake.set()
        if self._pump is None or self._pump.done():
            self._pump = loop.create_task(self._run_batch())

    def _advance(self, now: float) -> None:
        """Decode up to ``now``: every running request gains the steps that fit in the time since the last event."""
        start = max(self._clock, self._busy_until)
        if now > start and self.running:
            steps = self.cost.steps_in(len(self.running), self.context, (now - start) / self.time_scale)
            self.steps += steps
            self.context += steps * len(self.running)
        self._clock = max(self._clock, now)

    def _finish_due(self) -> None:
        for request_id, request in list(self.running.items()):
            if request.start_step + request.tokens <= self.steps + STEP_TOLERANCE:
                del self.running[request_id]
                self.context = max(0.0, self.context - request.prompt - request.tokens)
                self.reserved -= request.reserve
                if not request.future.done():
                    request.future.set_result((request.tokens, False))

    def _admit(self, now: float) -> None:
        prompts = squared = 0
        while self.queue:
            request_id, request = next(iter(self.queue.items()))
            if not self.cost.kv_admits(len(self.running), self.reserved, request.reserve, self.kv_capacity_tokens):
                break
            del self.queue[request_id]
            request.start_step = self.steps
            self.running[request_id] = request
            self.context += request.prompt
            self.reserved += request.reserve
            prompts += request.prompt
            squared += request.prompt * request.prompt
        if prompts:
            pause = self.time_scale * self.cost.prefill_s(prompts, squared)
            self._busy_until = max(self._busy_until, now) + pause

    def next_event(self) -> float:
        """Loop time the first running request finishes (inf when none runs)."""
        if not self.running:
            return math.inf
        steps = max(0.0, min(r.start_step + r.tokens for r in self.running.values()) - self.steps)
        start = max(self._clock, self._busy_until)
        return start + self.time_scale * self.cost.time_for_steps(len(self.running), self.context, steps)

    async def _run_batch(self) -> None:
        loop = asyncio.get_running_loop()
        wake = self._wake
        assert wake is not None
        while self.running or self.queue:
            self.wakeups += 1
            now = loop.time()
            self._advance(now)
            self._finish_due()
            self._admit(now)
            self.busy.update(self.in_flight, now)
            wait = self.next_event() - loop.time()
            wake.clear()
            if wait > 0:
                timer = loop.call_later(wait, wake.set)
                await wake.wait()
                timer.cancel()
            else:  # due already (a late wake-up): let the finished requests' callers run first
                await asyncio.sleep(0)
        self.busy.update(0, loop.time())


class PacedRolloutServer(RolloutServer):
    """A rollout server with no model, paced by ``pacer`` (default: :class:`FixedRate` at ``tokens_per_s``).

    Args:
        tokens_per_s: decode rate of one request (a GPU engine's per-sequence rate at its batch size), where no
            ``pacer`` is given.
        replica_rank: the replica's rank (for its records).
        max_model_len: prompt plus response tokens one request may hold.
        response_length: ``max_tokens`` of a request that sets none.
        token_id: the id of every generated token.
        logprob: the log-probability of every generated token.
        pacer: :class:`FixedRate` or :class:`GpuShapedDecode`.
    """

    backend_name = "areal_paced"
    releases_memory_on_sleep = False

    def __init__(
        self,
        tokens_per_s: float = 100.0,
        replica_rank: int = 0,
        max_model_len: int = 1 << 20,
        response_length: int = 1024,
        token_id: int = 7,
        logprob: float = -0.5,
        pacer: FixedRate | GpuShapedDecode | None = None,
    ) -> None:
        self.pacer = pacer if pacer is not None else FixedRate(tokens_per_s)
        self._init_gate(free_cache_engine=False)
        self.replica_rank = replica_rank
        self.max_model_len = max_model_len
        self.response_length = response_length
        self.token_id = token_id
        self.logprob = logprob
        self._version = 0
        self._generated_tokens = 0
        self._arrivals: dict[int, float] = {}

    @property
    def tokens_per_s(self) -> float | None:
        """The fixed rate of one request; None when a GPU case paces the engine."""
        return self.pacer.tokens_per_s if isinstance(self.pacer, FixedRate) else None

    # ------------------------------------------------------------------ generation

    async def generate(self, prompt_ids: list[int], *args: Any, **kwargs: Any) -> PacedOutput:
        """:meth:`RolloutServer.generate` (its arguments), with the first arrival of each prompt stamped, before the
        gate (:meth:`take_arrivals`)."""
        if prompt_ids:
            self._arrivals.setdefault(int(prompt_ids[0]), time.time())
        output: PacedOutput = await super().generate(prompt_ids, *args, **kwargs)
        return output

    def _token_output(self, **fields: Any) -> PacedOutput:
        """:class:`PacedOutput` instead of verl's ``TokenOutput``: the engine's process never imports verl."""
        return PacedOutput(**fields)

    async def _generate(
        self, prompt_ids: list[int], max_tokens: int, params: dict[str, Any], request_id: str, validation: bool = False
    ) -> Generated:
        # No validation_first: every request is paced alike (the capability is not declared, no mark arrives).
        tokens = self.pacer.length(request_id, max_tokens)
        count, aborted = await self.pacer.run(request_id, len(prompt_ids), tokens)
        self._generated_tokens += count
        version = self._version  # weights change only between an abort and a resume: one version per request
        return Generated(
            [self.token_id] * count,
            [self.logprob] * count,
            [version] * count,
            "aborted" if aborted else "completed",
        )

    @property
    def served_version(self) -> int:
        return self._version

    def take_arrivals(self) -> dict[int, float]:
        """When each prompt (by ``prompt_ids[0]``) first reached this server (``time.time()``), since the last call."""
        arrivals, self._arrivals = self._arrivals, {}
        return arrivals

    # ------------------------------------------------------------------ interruption

    async def _abort_in_flight(self) -> list[str]:
        return self.pacer.abort_all()

    async def abort_request(self, request_id: str, reset_prefix_cache: bool = True) -> dict[str, Any]:
        return {"aborted": self.pacer.abort(request_id), "request_id": request_id}

    async def wait_for_requests_to_drain(self) -> None:
        while self.pacer.in_flight:
            await asyncio.sleep(0.01)

    async def _resume_engine(self) -> None:
        return None

    # ------------------------------------------------------------------ memory (nothing to release)

    async def _release_memory(self, weights: bool = True) -> None:
        return None

    async def _restore_memory(self, tags: set[str]) -> None:
        return None

    async def clear_kv_cache(self) -> None:
        return None

    # ------------------------------------------------------------------ weights and statistics

    async def update_weights(self, state_dict: dict[str, Any], version: int) -> dict[str, Any]:
        """Serve ``version`` from now on (there are no weights to load); the reply names it."""
        self._version = int(version)
        return {"version": self._version, "tensors": len(state_dict)}

    @staticmethod
    def verify_weights(reply: dict[str, Any], state_dict: dict[str, Any], version: int, where: str) -> None:
        if reply.get("version") != version or reply.get("tensors") != len(state_dict):
            raise WeightSyncError(f"{where}: the paced engine reports {reply}, expected version {version}")

    async def get_version(self) -> int:
        return self._version

    async def get_stats(self) -> dict[str, Any]:
        return {
            "generated_tokens": self._generated_tokens,
            "in_flight": self.pacer.in_flight,
            "busy_s": self.pacer.busy.seconds(asyncio.get_running_loop().time()),
            "version": self._version,
        }


#: engine_kwargs.areal_paced's key prefix, for the messages.
_KEY = "actor_rollout_ref.rollout.engine_kwargs.areal_paced"
#: ``length_scale`` where a case is named and no scale: the paper's answers (mean 2,117 tokens, capped at 27,648)
#: 64 times shorter (mean 33, cap 432), so that a CPU trainer trains a step's batch in seconds.
DEFAULT_LENGTH_SCALE = 1 / 64


class VerlPacedServer(PacedRolloutServer):
    """:class:`PacedRolloutServer` as verl's replica builds a server (``rollout.name=areal_paced``).

    Without ``case``: every request decodes ``rollout.response_length`` tokens (verl's agent loop asks for no
    fewer) at ``engine_kwargs.areal_paced.tokens_per_s``; the constant token is not an end of sequence, so each
    answer runs to the limit, as the longest answers of a batch do.

    With ``case`` (a name of :data:`areal_bench.gpu_shaped.CASES`): :class:`GpuShapedDecode` as one of the
    case's engines, its answers ``length_scale`` times the case's (set ``rollout.response_length`` to the case's
    cap times the scale, ``tools/bench.py --workload gpu-shaped`` does), ``time_scale`` seconds here per second
    there, its KV cache the case engine's (``kv_capacity_tokens`` overrides it), the lengths seeded by the replica's
    seed (``rollout.seed`` + its rank).
    """

    capabilities = PacedRolloutServer.capabilities - {"weight_update", "weight_checksum"}
    #: The keys of ``engine_kwargs.areal_paced`` (the model-bound knobs of ``areal_cpu`` do not apply).
    engine_options = ("tokens_per_s", "case", "time_scale", "length_scale", "kv_capacity_tokens")

    def __init__(
        self,
        model_path: str,
        response_length: int,
        max_model_len: int,
        replica_rank: int = 0,
        tokens_per_s: float | None = None,
        free_cache_engine: bool = False,
        seed: int = 0,
        case: str | None = None,
        time_scale: float | None = None,
        length_scale: float | None = None,
        kv_capacity_tokens: float | None = None,
        **_unused: Any,  # the model-bound knobs our replica passes every backend (threads, batch size)
    ) -> None:
        if free_cache_engine:
            raise ValueError(
                "areal_paced holds no memory to release: set actor_rollout_ref.rollout.free_cache_engine=false"
            )
        for name, value in (
            ("tokens_per_s", tokens_per_s),
            ("time_scale", time_scale),
            ("length_scale", length_scale),
            ("kv_capacity_tokens", kv_capacity_tokens),
        ):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int | float) or not value > 0):
                raise ValueError(f"{_KEY}.{name} must be a number above 0, got {value!r}")
        pacer: FixedRate | GpuShapedDecode
        if case is None:
            gpu_keys = [k for k, v in (("time_scale", time_scale), ("length_scale", length_scale),
                                       ("kv_capacity_tokens", kv_capacity_tokens)) if v is not None]  # fmt: skip
            if gpu_keys:
                raise ValueError(f"{_KEY}: {', '.join(gpu_keys)} pace a GPU case: set {_KEY}.case too, or drop them")
            pacer = FixedRate(100.0 if tokens_per_s is None else tokens_per_s)
        else:
            if tokens_per_s is not None:
                raise ValueError(
                    f"{_KEY}: tokens_per_s is the fixed-rate engine's and case {case!r} paces by its decode model; "
                    "drop one of them"
                )
            pacer = gpu_shaped_pacer(
                case,
                time_scale=1.0 if time_scale is None else time_scale,
                length_scale=DEFAULT_LENGTH_SCALE if length_scale is None else length_scale,
                kv_capacity_tokens=kv_capacity_tokens,
                seed=seed,
            )
        super().__init__(
            replica_rank=replica_rank,
            max_model_len=max_model_len,
            response_length=response_length,
            pacer=pacer,
        )


def gpu_shaped_pacer(
    case: str, time_scale: float, length_scale: float, kv_capacity_tokens: float | None = None, seed: int = 0
) -> GpuShapedDecode:
    """:class:`GpuShapedDecode` as one engine of the GPU case named ``case``, its answers ``length_scale`` times
    the case's, ``time_scale`` seconds here per second there."""
    from areal_bench.gpu_shaped import case as find_case
    from areal_bench.gpu_shaped import scaled_lengths

    gpu_case = find_case(case, f"{_KEY}.case")
    try:
        mu, sigma, _ = scaled_lengths(gpu_case.workload, length_scale)
    except ValueError as error:
        raise ValueError(f"{_KEY}.{error}") from None
    engine = gpu_case.cluster.engine()
    capacity = engine.kv_capacity_tokens if kv_capacity_tokens is None else kv_capacity_tokens
    return GpuShapedDecode(engine.decode, capacity, time_scale, mu, sigma, seed=seed)


def _settle(done: asyncio.Future[bool], aborted: bool) -> None:
    if not done.done():
        done.set_result(aborted)
