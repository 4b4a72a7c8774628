"""verl's vLLM server and replica under ``areal_async``: our worker extension, weight reports, token counts.

:class:`ArealVLLMReplica` is verl's ``vLLMReplica`` building :class:`ArealVLLMHttpServer` actors instead of
verl's; the async trainer registers it for ``rollout.name: vllm`` in its own driver only
(:func:`use_checked_vllm_replicas`), so verl's own trainers keep verl's classes.
"""

from __future__ import annotations

import asyncio
from contextvars import ContextVar
from typing import Any

from verl.workers.rollout.vllm_rollout.vllm_async_server import vLLMHttpServer, vLLMReplica

from areal_plugins.rollout.activity import RequestActivity
from areal_plugins.rollout.base import SEED_FIELD, VALIDATION_KWARG, VALIDATION_PRIORITY
from areal_plugins.rollout.prompt_seeds import PromptSeeds
from areal_plugins.testing.holds import FinishFirstGroups, holds_from_custom

EXTENSION_CLASS = "areal_plugins.rollout.verl_vllm.worker_extension.ArealVLLMWorkerExtension"
#: ``actor_rollout_ref.rollout.custom.<this>: true`` seeds each request by its prompt (rollout/prompt_seeds.py).
SEEDED_SAMPLING_KEY = "areal_seeded_sampling"

#: This generate call's mark among the requests entering the engine. A call and the engine's ``add_request`` it
#: awaits run in one asyncio task, so both see it; two calls that share a request id do not share a mark.
_ENTERING: ContextVar[object | None] = ContextVar("areal_entering_engine", default=None)


class ArealVLLMHttpServer(vLLMHttpServer):
    """verl's server; its vLLM workers get our extension, and it counts what it generates. Under
    ``rollout.custom.areal_seeded_sampling`` each request samples with a seed derived from its prompt (off by
    default: vLLM samples seeded requests one by one, which costs time at thousands of requests in flight).

    An abort interrupts at once (:attr:`_admitting`): verl 0.9.1's abort first waits for every request past its
    gate to reach the engine, but counts a request as arriving only at its first output, so requests queued in
    the engine behind ``max_num_seqs`` held every abort (and every weight update) until they had started, up to
    verl's 60 s barrier timeout: the engine drained instead of being interrupted.

    A validation request (``VALIDATION_KWARG``, set by our client) goes to vLLM with priority
    :data:`~areal_plugins.rollout.base.VALIDATION_PRIORITY`: under ``rollout.scheduling_policy: priority`` (which
    ``areal.enable`` routes in async mode) vLLM's scheduler admits it ahead of every waiting training request
    (vLLM 0.30.0, ``v1/core/sched/request_queue.py``, ``PriorityRequestQueue``: (priority, arrival) order). Running
    requests are not preempted for it (the scheduler's waiting loop stops at ``max_num_seqs``); when KV blocks run
    out, the victim is the running request of the highest (priority, arrival), a training request. It is never held.
    """

    #: The tests' holds (``rollout.custom.areal_finish_groups_per_version``, testing/holds.py: areal_cpu's engine
    #: option, here at the server, since vLLM's scheduler is verl's); None: every request runs to its end.
    holds: FinishFirstGroups | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        #: Generate calls past the submission gate whose ``add_request`` into the engine has not returned yet, one
        #: mark per call (not its request id: a repeated id must not hide a second request from the abort).
        self._entering_engine: set[object] = set()
        super().__init__(*args, **kwargs)
        self.generated_tokens = 0
        self.activity = RequestActivity()
        custom = getattr(self.config, "custom", None) or {}
        # Each replica its own seeds (as areal_cpu's servers): the k-th answers to one prompt on two replicas differ.
        seed = int(self.config.seed) + int(self.replica_rank)
        self.prompt_seeds = PromptSeeds(seed) if custom.get(SEEDED_SAMPLING_KEY) else None
        self.holds = holds_from_custom(custom)
        self._release_held = asyncio.Event()  # set by the next abort: the held requests return, cut

    def _get_worker_extension_cls(self) -> str:
        return EXTENSION_CLASS

    async def generate(
        self, prompt_ids: list[int], sampling_params: dict[str, Any], request_id: str, *args: Any, **kwargs: Any
    ) -> Any:
        media = [kind for kind in ("image_data", "video_data", "audio_data") if kwargs.get(kind)]
        if media:  # startup refuses a VLM (images) where it reads the model's config; a hub id it cannot read
            raise ValueError(
                f"a request with {', '.join(media)} reached verl's vllm under areal_async, which has not run a "
                "vision-language model (its vision tower's per-update checks never ran): set areal.enable=false for "
                "verl's own trainer (docs/backends.md, Images)"
            )
        if self.prompt_seeds is not None and "seed" not in sampling_params:
            sampling_params = {**sampling_params, "seed": self.prompt_seeds.next(prompt_ids)}
        validation = bool(kwargs.pop(VALIDATION_KWARG, False))
        if validation:  # first in vLLM's waiting queue (scheduling_policy: priority), whatever verl's client passed
            kwargs["priority"] = min(int(kwargs.get("priority") or 0), VALIDATION_PRIORITY)
        held = not validation and self.holds is not None and self.holds.holds(list(prompt_ids))
        if held:  # a few tokens of this version, then wait for the abort that cuts it (tests only)
            assert self.holds is not None
            limit = min(int(sampling_params.get("max_tokens") or self.holds.hold_at_token), self.holds.hold_at_token)
            sampling_params = {**sampling_params, "max_tokens": limit}
            release = self._release_held
        _ENTERING.set(None)  # this call's mark, set once it passes the gate
        self.activity.enter()
        try:
            output = await super().generate(prompt_ids, sampling_params, request_id, *args, **kwargs)
            if held and getattr(output, "stop_reason", None) not in ("aborted", "abort"):
                await release.wait()
                output.stop_reason = "aborted"  # as if the abort had found it mid-answer, which it did
        finally:
            self.activity.leave()
            self._entering_engine.discard(_ENTERING.get())  # failed before reaching the engine: no abort waits for it
        if isinstance(getattr(output, "extra_fields", None), dict):  # the seed vLLM sampled with (None: its own)
            output.extra_fields[SEED_FIELD] = sampling_params.get("seed")
        return output

    async def abort_all_requests(self, reset_prefix_cache: bool = True, reject_request: bool = False) -> dict[str, Any]:
        result = await super().abort_all_requests(reset_prefix_cache=reset_prefix_cache, reject_request=reject_request)
        if self.holds is not None:  # the held requests return cut; the next version's first groups finish
            self._release_held.set()
            self._release_held = asyncio.Event()
            self.holds.new_version()
        return result

    @property
    def _admitting(self) -> int:
        """What verl's abort waits for: requests past the gate that the engine does not hold yet (verl's own count
        lasts until a request's first output). verl's increments and decrements of its count are ignored."""
        return len(self._entering_engine)

    @_admitting.setter
    def _admitting(self, _verls_count: int) -> None:
        pass

    async def _park_until_admitted(self, request_id: str) -> Any | None:
        self._count_tokens_as_decoded()
        rejected = await super()._park_until_admitted(request_id)
        if rejected is None:  # past the gate: no await between verl's gate check and this line
            self._count_until_in_engine(request_id)
        return rejected

    def _count_tokens_as_decoded(self) -> None:
        """Count tokens as vLLM streams them, not when a request returns: the stall guard and the step metrics read
        :attr:`generated_tokens` (a 16k-token answer at 25 tokens/s returns after 11 min). verl's ``generate``
        iterates ``self.engine.generate``; the engine's is wrapped once, counting each output's new tokens
        (cumulative outputs, vLLM's default; each output's own tokens under ``RequestOutputKind.DELTA``)."""
        engine = self.engine
        if getattr(engine, "_areal_counts_tokens", False):
            return
        generate = engine.generate

        async def generate_counted(*args: Any, **kwargs: Any) -> Any:
            kind = getattr(getattr(kwargs.get("sampling_params"), "output_kind", None), "name", "CUMULATIVE")
            counted = 0
            async for output in generate(*args, **kwargs):
                produced = sum(len(c.token_ids) for c in getattr(output, "outputs", None) or [])
                if kind == "DELTA":
                    self.generated_tokens += produced
                elif produced > counted:
                    self.generated_tokens += produced - counted
                    counted = produced
                yield output

        engine.generate = generate_counted
        engine._areal_counts_tokens = True

    def _count_until_in_engine(self, request_id: str) -> None:
        engine = self.engine
        if not getattr(engine, "_areal_counts_arrivals", False):
            add_request = engine.add_request
            entering = self._entering_engine

            async def add_request_counted(*args: Any, **kwargs: Any) -> Any:
                try:
                    return await add_request(*args, **kwargs)
                finally:
                    entering.discard(_ENTERING.get())

            engine.add_request = add_request_counted
            engine._areal_counts_arrivals = True
        mark = object()
        _ENTERING.set(mark)
        self._entering_engine.add(mark)

    async def get_stats(self) -> dict[str, Any]:
        """What the watchdog and the step metrics read (the same keys as our own servers report)."""
        return {
            "generated_tokens": self.generated_tokens,
            "in_flight": self.activity.in_flight,
            "busy_s": self.activity.busy_seconds(),
            "restarts": 0,
        }

    async def areal_weight_reports(self) -> list[dict[str, Any]]:
        """Each vLLM worker's checksums of the weights it received in the last update (verl's ``collective_rpc``
        wrapper drops the workers' answers, so the engine is asked directly)."""
        return list(await self.engine.collective_rpc("areal_weight_report"))


class ArealVLLMReplica(vLLMReplica):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        import ray

        super().__init__(*args, **kwargs)
        self.server_class = ray.remote(ArealVLLMHttpServer)

    @property
    def max_concurrency(self) -> int:
        """Every request the trainer can have in flight, plus control slots (rollout/server_slots.py)."""
        from areal_plugins.rollout.server_slots import server_concurrency

        return server_concurrency(super().max_concurrency)


def use_checked_vllm_replicas(rollout: Any = None) -> None:
    """Make ``rollout.name: vllm`` build :class:`ArealVLLMReplica` in this process (our trainers' driver).

    ``rollout`` (``actor_rollout_ref.rollout``, before verl builds its workers): marked so that the server adapter
    of every rank knows that the replica's workers run our extension, which joins a tensor cut into pieces
    (``custom.areal_joins_pieces``; weight_sync/split_tensors.py). verl gives only a replica's leading rank a handle
    on its server, so the other ranks cannot ask it.
    """
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    RolloutReplicaRegistry.register("vllm", lambda: ArealVLLMReplica)
    if rollout is not None:
        from omegaconf import open_dict

        from areal_plugins.weight_sync.split_tensors import JOINS_PIECES_KEY

        with open_dict(rollout):
            rollout.custom = {**(rollout.get("custom") or {}), JOINS_PIECES_KEY: True}
