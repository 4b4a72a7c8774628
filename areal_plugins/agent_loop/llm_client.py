"""The rollout client of our async trainer: interrupted requests continue as prompt + partial output.

verl's ``FullyAsyncLLMServerClient`` does the same resubmission but sleeps a fixed 1 s before each
retry and keeps only the first and last version of a trajectory. Ours resubmits at once (the
server parks the request behind its closed gate until generation resumes, so nothing spins) and
keeps the generating version of every token, which is what staleness and the log-linear proximal
approximation need (docs/design.md, Versions). Runs inside verl's agent-loop workers.

The fields of verl's ``TokenOutput`` that span the requests of one call are merged as verl's own client merges
them (:class:`SpanningFields`): ``routed_experts`` (router replay) cover the prompt and every response token,
``num_preempted`` is summed, ``num_cached_tokens`` is the first prefill's. verl keeps that merge inline in its
``generate`` loop (no function to call), so ours is a copy held to verl's by tests/unit/test_client_vs_verl.py, which
runs both clients through the same interrupted request.

A request of verl's validation (its episode's record says so) is marked for the server
(``rollout.base.VALIDATION_KWARG``) where the backend declares ``validation_first``: the server admits it ahead of
the training backlog (docs/backends.md, Validation goes first).

A request whose server died (``placement: separate`` with several replicas) continues the same way on another
replica: the dead server leaves the load balancer, and the tokens it returned before dying are kept
(docs/faults.md, A rollout replica dies).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

import numpy as np
import ray
from omegaconf import OmegaConf
from verl.workers.rollout.llm_server import LLMServerClient

from areal_plugins.agent_loop.episodes import CURRENT_EPISODE, version_fields
from areal_plugins.agent_loop.partial_outputs import PartialOutput, compact, finished_output, keep, take_resumed
from areal_plugins.agent_loop.routed_experts import require_recorded_routes, routed_experts_fields
from areal_plugins.core.trajectory_rows import CHUNKS_FIELD, MEDIA_FIELD, images_digest, prompt_digest
from areal_plugins.rollout.base import SEED_FIELD, VALIDATION_KWARG

logger = logging.getLogger(__name__)

ABORTED = ("aborted", "abort")
#: How many dead servers one request may meet before its group fails (and is re-issued by admission).
MAX_FAILOVERS = 8


def current_answer() -> tuple[str, int] | None:
    """Which answer of which prompt group the current agent-loop task generates (what a checkpoint keeps it under),
    or None outside an episode that knows both."""
    episode = CURRENT_EPISODE.get()
    if episode is None or episode.group_uid is None or episode.session is None:
        return None
    return (episode.group_uid, episode.session)


@dataclass
class SpanningFields:
    """verl's rollout-output fields that span the requests of one interrupted call, merged request by request as
    verl 0.9.1's ``FullyAsyncLLMServerClient.generate`` merges them (``verl/workers/rollout/llm_server.py``)."""

    #: (prompt + response tokens, layers, top-k) expert ids: the first request's whole array (its prompt's rows
    #: and its tokens'), then only the rows of each later request's new tokens (the resubmitted prefix was
    #: routed again under newer weights; the tokens keep the routing that generated them).
    routed_experts: Any = None
    num_preempted: int = 0  # summed over the requests (0 when no engine reports it, as verl's)
    num_cached_tokens: int | None = None  # the first prefill's prefix-cache hits, the only one of the prompt alone

    def add(self, output: Any) -> None:
        """Merge one request's ``TokenOutput``."""
        new = len(output.token_ids)
        if output.routed_experts is not None and new:
            checked = len(output.routed_experts) if self.routed_experts is None else new  # a resumed prefix: kept
            require_recorded_routes(output.routed_experts, checked)
            if self.routed_experts is None:
                self.routed_experts = output.routed_experts
            else:
                self.routed_experts = np.concatenate([self.routed_experts, output.routed_experts[-new:]])
        if output.num_preempted is not None:
            self.num_preempted += output.num_preempted
        if self.num_cached_tokens is None:
            self.num_cached_tokens = output.extra_fields.get("num_cached_tokens")


class InterruptibleLLMClient(LLMServerClient):
    """``LLMServerClient`` that resumes aborted requests and merges tokens, log-probs and versions.

    The merged output's ``extra_fields`` hold ``token_versions`` (one per response token),
    ``min_global_steps``/``max_global_steps`` (head and tail version, which verl copies into the
    trajectory's TransferQueue tags), ``num_interrupts`` and ``areal_chunks`` (where each request of the call
    started in the response, under which version and with which seed: the record a replay follows). Inside an
    agent-loop episode the turn is also added to the episode's record, whose fields cover every turn
    (agent_loop/episodes.py).
    """

    async def _acquire_server(self, request_id: str, **extra: Any) -> tuple[str, Any]:
        server_id, server = await super()._acquire_server(request_id, **extra)
        self._routed_to()[request_id] = server_id  # which server to drop if this call dies with it
        return server_id, server

    def _checkpoints(self) -> bool:
        """Whether the run checkpoints (``trainer.save_freq > 0``): only then are outputs kept for one."""
        if "_checkpoints_on" not in self.__dict__:  # lazily: verl builds the client, and pickles it to workers
            self.__dict__["_checkpoints_on"] = (
                OmegaConf.select(self.config, "trainer.save_freq", default=-1) or -1
            ) > 0
        return bool(self.__dict__["_checkpoints_on"])

    def _validation_first(self) -> bool:
        """Whether the backend admits validation requests first (declares ``validation_first``): only then is the
        mark sent (verl's sglang server, for one, takes no keyword it does not know)."""
        # Cached under another name than the method's: an instance attribute of its name would hide the method.
        if "_validation_first_on" not in self.__dict__:  # lazily: verl builds the client, and pickles it to workers
            from areal_plugins.rollout.capabilities import provided_capabilities

            backend = str(self.config.actor_rollout_ref.rollout.name)
            self.__dict__["_validation_first_on"] = "validation_first" in provided_capabilities(backend)
        return bool(self.__dict__["_validation_first_on"])

    def _routed_to(self) -> dict[str, str]:
        return self.__dict__.setdefault("_routed", {})  # lazily: verl builds the client, and pickles it to workers

    async def _drop_dead_server(self, request_id: str, error: Exception) -> None:
        """The server of ``request_id`` died: take it out of the shared load balancer (idempotent)."""
        server_id = self._routed_to().pop(request_id, None)
        if server_id is None:
            raise error
        dropped = self.__dict__.setdefault("_dropped", set())
        if server_id not in dropped:  # once per server and worker, not once per request in flight
            dropped.add(server_id)
            logger.warning("rollout server %s died: its requests continue on another replica", server_id)
            await self._load_balancer.remove_servers.remote([server_id])

    async def generate(self, request_id: str, *, prompt_ids: list[int], sampling_params: dict[str, Any], **kwargs: Any):
        from verl.workers.rollout.replica import TokenOutput

        episode = CURRENT_EPISODE.get()
        answer = current_answer()
        params = dict(sampling_params)  # the caller reuses its dict across turns
        limit_key = "max_new_tokens" if "max_new_tokens" in params else "max_tokens"
        budget = params.get(limit_key) or self.config.actor_rollout_ref.rollout.response_length
        if episode is not None:
            episode.enter_engine()
            if episode.validation and self._validation_first():  # ahead of the training backlog, never held
                kwargs[VALIDATION_KWARG] = True
        media = images_digest(kwargs.get("image_data"))  # what tells apart prompts of one text
        # A resumed run continues the output its checkpoint kept for this answer.
        partial = await take_resumed(*answer, prompt_ids, media) if answer is not None else None
        if answer is not None and self._checkpoints():  # what a checkpoint keeps, until the group settles
            partial = partial or PartialOutput(prompt_digest(list(prompt_ids), media))
            keep(*answer, partial)
        if partial is not None and partial.stop_reason is not None:  # it had finished before the checkpoint
            return finished_output(partial, episode)
        partial = partial or PartialOutput("")
        # The lists are extended in place: the checkpoint's copy sees every finished request.
        token_ids, log_probs, versions, chunks = partial.tokens, partial.log_probs, partial.versions, partial.chunks
        spanning = SpanningFields(routed_experts=partial.routed_experts)  # a resumed answer's rows so far
        failovers = 0
        while True:
            params[limit_key] = budget - len(token_ids)
            try:
                output = await self._generate_once(
                    request_id, prompt_ids=list(prompt_ids) + token_ids, sampling_params=params, **kwargs
                )
            except ray.exceptions.ActorDiedError as error:  # the server is gone for good (never restarted)
                failovers += 1
                if failovers > MAX_FAILOVERS:
                    raise
                await self._drop_dead_server(request_id, error)
                continue
            finally:
                self._routed_to().pop(request_id, None)
            spanning.add(output)
            partial.routed_experts = spanning.routed_experts  # what a checkpoint keeps with the tokens
            chunk_versions = output.extra_fields.get("token_versions")
            if chunk_versions is None:  # a backend without per-token versions: stamp the served version
                chunk_versions = [output.extra_fields.get("global_steps", 0)] * len(output.token_ids)
            if output.token_ids:
                chunks.append([len(token_ids), chunk_versions[0], output.extra_fields.get(SEED_FIELD)])
            token_ids.extend(output.token_ids)
            if output.log_probs is not None:
                log_probs.extend(output.log_probs)
            versions.extend(chunk_versions)
            if output.stop_reason not in ABORTED or len(token_ids) >= budget:
                break
            partial.interrupts += 1
            if not output.token_ids:  # a server rejecting requests while paused: do not spin
                await asyncio.sleep(0.01)
        interrupts = partial.interrupts
        if episode is not None:
            episode.add_turn(versions, interrupts, chunks)
        extra = {**output.extra_fields, **version_fields(versions), "num_interrupts": interrupts}
        extra[CHUNKS_FIELD] = [list(chunk) for chunk in chunks]
        if media is not None:
            extra[MEDIA_FIELD] = media
        extra["num_cached_tokens"] = spanning.num_cached_tokens
        extra.update(routed_experts_fields(spanning.routed_experts))
        extra.pop(SEED_FIELD, None)  # the last request's: each request's seed is in its chunk
        stop_reason = "length" if output.stop_reason in ABORTED else output.stop_reason
        partial.stop_reason = stop_reason
        if answer is not None and self._checkpoints():
            compact(partial)  # kept until the group settles: as packed arrays, not lists of Python numbers
        return TokenOutput(
            token_ids=token_ids,
            log_probs=log_probs if output.log_probs is not None or log_probs else None,
            routed_experts=spanning.routed_experts,
            stop_reason=stop_reason,
            num_preempted=spanning.num_preempted,
            extra_fields=extra,
        )

    async def _generate_once(self, request_id: str, **kwargs: Any) -> Any:
        """One request to a server (verl's client): what a replay asks for each recorded request."""
        return await super().generate(request_id, **kwargs)
