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

Two differences from a real server, both for the cost of starting many of them on a small machine:
:meth:`PacedRolloutServer.generate` returns :class:`PacedOutput`, which has the fields of verl's ``TokenOutput``
(our client and verl's read only those), so that an engine process never imports verl (10 s of CPU and 580 MB
each); and the first arrival of each prompt (``prompt_ids[0]``, the bench's group index) is stamped, for
:meth:`PacedRolloutServer.take_arrivals`.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from areal_plugins.rollout.base import Generated, RolloutServer, token_budget, version_fields
from areal_plugins.weight_sync.errors import WeightSyncError


@dataclass
class PacedOutput:
    """What one request returns: the fields of verl's ``TokenOutput``, without importing verl."""

    token_ids: list[int]
    log_probs: list[float] | None = None
    routed_experts: Any = None
    stop_reason: str | None = None
    num_preempted: int | None = None
    extra_fields: dict[str, Any] = field(default_factory=dict)


class PacedRolloutServer(RolloutServer):
    """A rollout server that "decodes" ``tokens_per_s`` tokens per second per request, with no model.

    Args:
        tokens_per_s: decode rate of one request (a GPU engine's per-sequence rate at its batch size).
        replica_rank: the replica's rank (for its records).
        max_model_len: prompt plus response tokens one request may hold.
        response_length: ``max_tokens`` of a request that sets none.
        token_id: the id of every generated token.
        logprob: the log-probability of every generated token.
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
    ) -> None:
        if not tokens_per_s > 0:
            raise ValueError(f"tokens_per_s must be > 0, got {tokens_per_s!r}")
        self._init_gate(free_cache_engine=False)
        self.tokens_per_s = float(tokens_per_s)
        self.replica_rank = replica_rank
        self.max_model_len = max_model_len
        self.response_length = response_length
        self.token_id = token_id
        self.logprob = logprob
        self._version = 0
        # request id -> (its future: True when aborted, its timer, start time on the loop's clock)
        self._running: dict[str, tuple[asyncio.Future[bool], asyncio.TimerHandle, float]] = {}
        self._generated_tokens = 0
        self._busy_s = 0.0
        self._busy_since: float | None = None
        self._arrivals: dict[int, float] = {}

    # ------------------------------------------------------------------ generation

    async def generate(
        self,
        prompt_ids: list[int],
        sampling_params: dict[str, Any],
        request_id: str,
        image_data: Any = None,
        video_data: Any = None,
        audio_data: Any = None,
        **kwargs: Any,
    ) -> PacedOutput:
        """:meth:`RolloutServer.generate`, returning :class:`PacedOutput` instead of verl's ``TokenOutput``."""
        if prompt_ids:
            self._arrivals.setdefault(int(prompt_ids[0]), time.time())
        params = dict(sampling_params)
        media = bool(image_data or video_data or audio_data)
        max_tokens = token_budget(
            self.backend_name, prompt_ids, params, self.max_model_len, self.response_length, media
        )
        if not await self._wait_for_gate():
            out = Generated([], [], [], "aborted")
        else:
            out = await self._generate(prompt_ids, max_tokens, params, request_id)
        return PacedOutput(
            token_ids=out.token_ids,
            log_probs=out.logprobs if params.get("logprobs") else None,
            stop_reason=out.stop_reason,
            extra_fields=version_fields(self.served_version, out.versions, out.seed),
        )

    async def _generate(
        self, prompt_ids: list[int], max_tokens: int, params: dict[str, Any], request_id: str
    ) -> Generated:
        loop = asyncio.get_running_loop()
        done: asyncio.Future[bool] = loop.create_future()
        started = loop.time()
        timer = loop.call_later(max_tokens / self.tokens_per_s, _settle, done, False)
        if not self._running:
            self._busy_since = started
        self._running[request_id] = (done, timer, started)
        try:
            aborted = await done
        finally:
            self._running.pop(request_id, None)
            if not self._running and self._busy_since is not None:
                self._busy_s += loop.time() - self._busy_since
                self._busy_since = None
        count = min(max_tokens, int((loop.time() - started) * self.tokens_per_s)) if aborted else max_tokens
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
        request_ids = list(self._running)
        for done, timer, _ in self._running.values():
            timer.cancel()
            _settle(done, True)
        return request_ids

    async def abort_request(self, request_id: str, reset_prefix_cache: bool = True) -> dict[str, Any]:
        entry = self._running.get(request_id)
        if entry is not None:
            entry[1].cancel()
            _settle(entry[0], True)
        return {"aborted": entry is not None, "request_id": request_id}

    async def wait_for_requests_to_drain(self) -> None:
        while self._running:
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
        busy = self._busy_s
        if self._busy_since is not None:
            busy += asyncio.get_running_loop().time() - self._busy_since
        return {
            "generated_tokens": self._generated_tokens,
            "in_flight": len(self._running),
            "busy_s": busy,
            "version": self._version,
        }


class VerlPacedServer(PacedRolloutServer):
    """:class:`PacedRolloutServer` as verl's replica builds a server (``rollout.name=areal_paced``).

    Every request decodes ``rollout.response_length`` tokens (verl's agent loop asks for no fewer) at
    ``engine_kwargs.areal_paced.tokens_per_s``; the constant token is not an end of sequence, so each
    answer runs to the limit, as the longest answers of a batch do.
    """

    capabilities = PacedRolloutServer.capabilities - {"weight_update", "weight_checksum"}
    #: The keys of ``engine_kwargs.areal_paced`` (the model-bound knobs of ``areal_cpu`` do not apply).
    engine_options = ("tokens_per_s",)

    def __init__(
        self,
        model_path: str,
        response_length: int,
        max_model_len: int,
        replica_rank: int = 0,
        tokens_per_s: float = 100.0,
        free_cache_engine: bool = False,
        **_unused: Any,  # the model-bound knobs our replica passes every backend (threads, seed, batch size)
    ) -> None:
        if isinstance(tokens_per_s, bool) or not isinstance(tokens_per_s, int | float) or not tokens_per_s > 0:
            raise ValueError(
                "actor_rollout_ref.rollout.engine_kwargs.areal_paced.tokens_per_s must be a number of tokens per "
                f"second above 0, got {tokens_per_s!r}"
            )
        if free_cache_engine:
            raise ValueError(
                "areal_paced holds no memory to release: set actor_rollout_ref.rollout.free_cache_engine=false"
            )
        super().__init__(
            tokens_per_s=tokens_per_s,
            replica_rank=replica_rank,
            max_model_len=max_model_len,
            response_length=response_length,
        )


def _settle(done: asyncio.Future[bool], aborted: bool) -> None:
    if not done.done():
        done.set_result(aborted)
