"""The contract every areal rollout server keeps, and what all of them do the same way.

A rollout server is a Ray actor that verl 0.9.1 drives exactly as it drives its own vLLM server
actor: verl's ``LLMServerClient`` calls :meth:`RolloutServer.generate`; ``RolloutReplica`` and
``CheckpointEngineManager`` call abort / resume / sleep / wake-up / cache control; our trainer-side
adapter (:mod:`areal_plugins.rollout.verl_registration`) calls :meth:`RolloutServer.update_weights`
and checks the reply with :meth:`RolloutServer.verify_weights`. Every response carries the
generating version of each token (``extra_fields["token_versions"]``).

A backend is a subclass in its own subpackage (``rollout/cpu``) that declares its
name and capabilities as class attributes; nothing outside a backend branches on its name.
"""

from __future__ import annotations

import abc
import asyncio
import time
from dataclasses import dataclass
from typing import Any, ClassVar

from areal_plugins.records.writer import append_record

#: ``generate`` keyword marking a request of verl's periodic validation (``trainer.test_freq``): a server that declares
#: the ``validation_first`` capability admits it ahead of every waiting training request and never holds it
#: (testing/holds.py). Our rollout client sets it (agent_loop/llm_client.py) only for a backend that declares it.
VALIDATION_KWARG = "areal_validation"
#: vLLM's request priority of a validation request (``scheduling_policy: priority``: lower is scheduled first, ties in
#: arrival order): below any a training request carries (verl's agent loop passes 0, or a dataset's own small index).
VALIDATION_PRIORITY = -(2**31)


class RolloutServer(abc.ABC):
    """Base class of an areal rollout server actor (verl's server contract).

    Subclasses set :attr:`backend_name` and :attr:`releases_memory_on_sleep`, implement the
    abstract methods, and call :meth:`_init_gate` in their constructor.

    Memory follows verl's ``rollout.free_cache_engine``: with it true, :meth:`sleep` releases what a
    GPU engine releases (KV caches and weights) and :meth:`wake_up` restores it; with it false verl's
    own servers keep their memory on sleep, and so do ours.
    """

    #: ``actor_rollout_ref.rollout.name`` of this backend.
    backend_name: ClassVar[str]
    #: What ``areal_async`` may rely on (names of ``rollout.capabilities.CAPABILITIES``); the abstract methods
    #: that keep them are ``CONTRACT_METHODS``. A backend whose engine cannot keep one narrows this set,
    #: and a recipe using it is refused at startup unless it waives what is missing.
    capabilities: ClassVar[frozenset[str]] = frozenset(
        {"abort_keeps_partial", "resume", "weight_update", "version_stamps", "weight_checksum", "progress_stats"}
    )
    #: Whether :meth:`sleep` can release the engine's memory (``free_cache_engine: true`` needs it;
    #: a backend without it is refused at startup with that setting).
    releases_memory_on_sleep: ClassVar[bool]
    #: Whether, on a GPU machine, the server runs on the GPUs Ray reserved for its replica's workers
    #: (it then takes a ``gpu`` argument); False: it computes on the CPU wherever it runs.
    uses_reserved_gpus: ClassVar[bool] = False

    free_cache_engine: bool
    #: verl's ``rollout.ignore_eos``: the default of a request that does not set ``ignore_eos`` itself.
    ignore_eos: bool = False
    replica_rank: int
    max_model_len: int
    response_length: int
    _gate_open: asyncio.Event
    _rejecting: bool

    def _init_gate(self, free_cache_engine: bool) -> None:
        self.free_cache_engine = free_cache_engine
        self._gate_open = asyncio.Event()
        self._gate_open.set()
        self._rejecting = False

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
    ) -> Any:
        """Token-in/token-out generation with per-token log-probs and versions (verl's ``TokenOutput``).

        verl's stop reasons: ``completed``, or ``aborted`` for a request cut short (verl's client
        re-submits it as prompt + partial output). ``kwargs[VALIDATION_KWARG]``: a validation request, which a
        backend declaring ``validation_first`` admits ahead of the training backlog.
        """
        validation = bool(kwargs.pop(VALIDATION_KWARG, False))
        params = dict(sampling_params)
        params.setdefault("ignore_eos", self.ignore_eos)  # as verl's vLLM server does
        refused_media = [
            kind
            for kind, data, served in (
                ("images", image_data, "images" in self.capabilities),
                ("videos", video_data, False),
                ("audio", audio_data, False),
            )
            if data and not served
        ]
        max_tokens = token_budget(
            self.backend_name, prompt_ids, params, self.max_model_len, self.response_length, refused_media
        )
        media = {"images": list(image_data)} if image_data else {}
        if not await self._wait_for_gate():
            out = Generated([], [], [], "aborted")
        else:
            out = await self._generate(prompt_ids, max_tokens, params, request_id, validation=validation, **media)
        return self._token_output(
            token_ids=out.token_ids,
            log_probs=out.logprobs if params.get("logprobs") else None,
            stop_reason=out.stop_reason,
            routed_experts=out.routed_experts,
            extra_fields=version_fields(self.served_version, out.versions, out.seed),
        )

    def _token_output(self, **fields: Any) -> Any:
        """What :meth:`generate` returns, built from ``fields`` (the keywords of verl's ``TokenOutput``).

        verl's ``TokenOutput``. A server whose process must not import verl (a stand-in without a model) returns
        an object with the same fields instead; verl's client and ours read only those.
        """
        from verl.workers.rollout.replica import TokenOutput

        return TokenOutput(**fields)

    @abc.abstractmethod
    async def _generate(
        self,
        prompt_ids: list[int],
        max_tokens: int,
        params: dict[str, Any],
        request_id: str,
        validation: bool = False,
        images: list[Any] | None = None,
    ):
        """Generate up to ``max_tokens``; a :class:`Generated` (stop reason ``completed`` or ``aborted``).
        ``validation``: a request of verl's validation (what ``validation_first`` admits first). ``images``: the
        prompt's images, passed only to a backend that declares the ``images`` capability."""

    @property
    @abc.abstractmethod
    def served_version(self) -> int:
        """The policy version of the weights the engine serves now."""

    async def _wait_for_gate(self) -> bool:
        """Park a request while generation is paused; False when the server rejects it instead."""
        while not self._gate_open.is_set():
            if self._rejecting:
                return False
            await self._gate_open.wait()
        return True

    # ------------------------------------------------------------------ interruption

    @abc.abstractmethod
    async def _abort_in_flight(self) -> list[str]:
        """Stop every in-flight request (each returns its partial output); their request ids."""

    @abc.abstractmethod
    async def abort_request(self, request_id: str, reset_prefix_cache: bool = True) -> dict[str, Any]:
        """Stop one request (it returns its partial output); ``{"aborted": bool, "request_id": ...}``."""

    @abc.abstractmethod
    async def wait_for_requests_to_drain(self) -> None:
        """Return once no request is in flight."""

    async def abort_all_requests(self, reset_prefix_cache: bool = True, reject_request: bool = False) -> dict:
        """Close the gate and interrupt every in-flight request; new ones wait (or fail with ``reject_request``)."""
        self._rejecting = reject_request
        self._gate_open.clear()
        request_ids = await self._abort_in_flight()
        record_replica_event(self.replica_rank, "abort", aborted=len(request_ids))
        return {"aborted_count": len(request_ids), "request_ids": request_ids}

    async def resume_engine_generation(self) -> None:
        """verl splits resuming into the engine and the submission gate; ours resume together."""
        await self.resume_generation()

    async def open_submission_gate(self) -> None:
        await self.resume_generation()

    async def resume_generation(self) -> None:
        """Let parked and new requests run again (after the engine itself resumed)."""
        await self._resume_engine()
        self._rejecting = False
        self._gate_open.set()
        record_replica_event(self.replica_rank, "resume", version=self.served_version, **self._memory())

    @abc.abstractmethod
    async def _resume_engine(self) -> None:
        """Make the engine generate again; raise when it cannot (e.g. no weights since a sleep)."""

    # ------------------------------------------------------------------ memory

    async def sleep(self) -> None:
        """Release KV caches and weights (``free_cache_engine: true``); in-flight requests must be aborted first."""
        if not self.free_cache_engine:
            record_replica_event(self.replica_rank, "sleep", released=False)
            return  # verl's own servers keep their memory too (rollout.free_cache_engine: false)
        await self._release_memory()
        record_replica_event(self.replica_rank, "sleep", released=True, **self._memory())

    async def wake_up(self, tags: list[str] | None = None) -> None:
        """Restore what :meth:`sleep` released: ``tags`` among ``weights``, ``kv_cache`` (None: both)."""
        if not self.free_cache_engine:
            return
        await self._restore_memory(set(tags or ("weights", "kv_cache")))
        record_replica_event(self.replica_rank, "wake_up", tags=sorted(tags or ("weights", "kv_cache")))

    async def release_kv_cache(self) -> None:
        if self.free_cache_engine:
            await self._release_memory(weights=False)

    async def resume_kv_cache(self) -> None:
        if self.free_cache_engine:
            await self._restore_memory({"kv_cache"})

    @abc.abstractmethod
    async def _release_memory(self, weights: bool = True) -> None: ...

    def _memory(self) -> dict[str, int]:
        """Bytes the engine holds now (``weight_bytes``, ``kv_cache_bytes``), where it can tell."""
        return {}

    @abc.abstractmethod
    async def _restore_memory(self, tags: set[str]) -> None: ...

    @abc.abstractmethod
    async def clear_kv_cache(self) -> None:
        """Drop cached KV state computed under earlier weights."""

    # ------------------------------------------------------------------ weights

    @abc.abstractmethod
    async def update_weights(self, state_dict: dict[str, Any], version: int) -> dict[str, Any]:
        """Load ``state_dict`` and serve it as ``version``; what the engine reports it now holds."""

    @staticmethod
    @abc.abstractmethod
    def verify_weights(reply: dict[str, Any], state_dict: dict[str, Any], version: int, where: str) -> None:
        """Raise :class:`WeightSyncError` unless ``reply`` shows ``state_dict`` loaded as ``version``."""

    async def update_adapter(
        self, tensors: dict[str, Any], peft_config: dict[str, Any], version: int
    ) -> dict[str, Any]:
        """Load a LoRA adapter (verl's adapter-only update: peft's tensors and ``peft_config``) onto the base weights
        and serve them as ``version``; ``{"version", "adapter_reports"}``: one report per engine rank of what it
        received and holds (weight_sync/adapter_check.py). A backend that declares ``lora_adapter_check`` implements
        it; the others are refused LoRA at startup."""
        raise NotImplementedError(
            f"the {self.backend_name} rollout backend does not serve LoRA adapters (it does not declare "
            "lora_adapter_check): set actor_rollout_ref.model.lora_rank=0"
        )

    @staticmethod
    def verify_adapter(reply: dict[str, Any], sent: dict[str, list[float]], version: int, where: str) -> dict[str, int]:
        """Raise :class:`WeightSyncError` unless ``reply`` (of :meth:`update_adapter`) shows every engine rank holding
        the adapter the trainer sent (``sent``: each tensor's checksum) as ``version``; what was compared."""
        from areal_plugins.weight_sync.adapter_check import check_adapter_reports
        from areal_plugins.weight_sync.errors import WeightSyncError

        if reply.get("version") != version:
            raise WeightSyncError(
                f"LoRA adapter update to {where}: the server reports version {reply.get('version')}, the trainer sent "
                f"version {version}. The rollout would keep sampling a stale adapter; stopping."
            )
        return check_adapter_reports(sent, reply["adapter_reports"], version, reply.get("ranks_per_replica"))

    @abc.abstractmethod
    async def get_version(self) -> int: ...

    @abc.abstractmethod
    async def get_stats(self) -> dict[str, Any]:
        """``generated_tokens``, ``in_flight``, ``busy_s``, ``version`` (and ``restarts`` where servers restart)."""


#: ``extra_fields`` key of the seed a server sampled one request with (None: unknown, e.g. vLLM unseeded).
SEED_FIELD = "areal_seed"


@dataclass
class Generated:
    """What one request produced: tokens with their log-probs and generating versions, and why it stopped."""

    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    stop_reason: str
    #: the seed the engine sampled with (None where it cannot say)
    seed: int | None = None
    #: router replay: the experts of every token fed through the model, (tokens, MoE layers, top-k) as verl's vLLM
    #: server returns them (``TokenOutput.routed_experts``); None where not recorded
    routed_experts: Any = None


def token_budget(
    backend: str,
    prompt_ids: list[int],
    params: dict[str, Any],
    max_model_len: int,
    response_length: int,
    refused: list[str],
) -> int:
    """``max_tokens`` of a request (popped from ``params``), within ``max_model_len``. ``refused``: the kinds of input
    the request carries that the backend does not serve (videos, audio; images where it lacks the ``images``
    capability)."""
    if refused:
        raise ValueError(
            f"the {backend} rollout backend does not serve {', '.join(refused)} (a request carried them): train a "
            "model whose prompts hold no such inputs, or use a backend that serves them (docs/support.md)"
        )
    room = max_model_len - len(prompt_ids)
    if room < 1:
        raise ValueError(
            f"prompt of {len(prompt_ids)} tokens leaves no room within max_model_len={max_model_len}; "
            "raise data.max_prompt_length/rollout.response_length or shorten the prompt"
        )
    max_tokens = params.pop("max_tokens", params.pop("max_new_tokens", response_length))
    return max(1, min(int(max_tokens), room))


def version_fields(served_version: int, versions: list[int], seed: int | None = None) -> dict[str, Any]:
    """``extra_fields`` of a response: the served version, the version of every token and the sampling seed."""
    extra: dict[str, Any] = {"global_steps": served_version, "token_versions": versions, SEED_FIELD: seed}
    if versions:
        extra["min_global_steps"] = min(versions)
        extra["max_global_steps"] = max(versions)
    return extra


def record_replica_event(replica: int, event: str, **fields: Any) -> None:
    """``replica_events.jsonl``: what verl asked of each replica, in order (abort, sleep, wake_up, update, resume)."""
    append_record("replica_events.jsonl", {"time": time.time(), "replica": replica, "event": event, **fields})


def record_weight_sync(replica: int, version: int, checksum: Any, event: str) -> None:
    """``weight_syncs.jsonl``: an audit trail of the weights each replica served."""
    record = {"time": time.time(), "replica": replica, "event": event, "version": version, "checksum": checksum}
    append_record("weight_syncs.jsonl", record)
