"""verl's TransferQueue agent-loop workers, with an :class:`EpisodeRecord` per episode (multi-turn rollouts).

``areal.enable: true`` in async mode routes ``actor_rollout_ref.rollout.agent.agent_loop_manager_class``
here. Each agent-loop task (one episode: verl's single-turn loop, its ``tool_agent`` loop, or a
loop registered by the user) gets its own record: the rollout client adds every turn's token
versions to it, the tool wrapper each tool call's latency and failure. Before the trajectory goes
to TransferQueue the record's fields replace the loop's own, so versions cover every turn.

An episode that stays outside the engine (a tool or environment step) longer than
``areal.episodes.environment_timeout_s`` is cancelled and fails: its group is counted as failed and
re-issued by the admission loop, and the run goes on (docs/multi_turn.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import ray
from verl.trainer.ppo.v1.agent_loop_tq import AgentLoopManagerTQ, AgentLoopWorkerTQ

from areal_plugins.actors.settled_groups import report_settled
from areal_plugins.agent_loop.episodes import CURRENT_EPISODE, EpisodeRecord
from areal_plugins.agent_loop.partial_outputs import (
    end_resume,
    forget_group,
    prepare_resume,
    snapshot_in_flight,
    write_partials,
)
from areal_plugins.config.settings import areal_settings
from areal_plugins.core.trajectory_rows import output_summary

logger = logging.getLogger(__name__)

#: Longest pause between two looks at an episode's time outside the engine.
CHECK_S = 1.0


class EpisodeStalledError(TimeoutError):
    """An episode spent longer than its limit in a tool call or environment step."""


class EpisodeAgentLoopWorker(AgentLoopWorkerTQ.__ray_actor_class__):  # type: ignore[name-defined,misc]
    """verl's ``AgentLoopWorkerTQ``: one :class:`EpisodeRecord` per agent-loop task, tools accounted."""

    def __init__(self, config: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(config, *args, **kwargs)
        self.environment_timeout_s = areal_settings(config).episodes.environment_timeout_s
        for tool in self.tools:
            account_tool_calls(tool)

    async def _run_agent_loop(self, *args: Any, **kwargs: Any) -> Any:
        # verl's _validate's prompts (verl's TransferQueue worker passes the trajectory by keyword, its base class
        # positionally)
        trajectory = kwargs.get("trajectory", args[1] if len(args) > 1 else None) or {}
        validation = bool(trajectory.get("validate", False))
        record = EpisodeRecord(group_uid=kwargs.get("uid"), session=kwargs.get("session_id"), validation=validation)
        CURRENT_EPISODE.set(record)  # the task below starts from a copy of this context: same record
        episode = asyncio.create_task(super()._run_agent_loop(*args, **kwargs))
        watch = self._watch()
        watch.add(episode, record)
        try:
            return await episode
        except asyncio.CancelledError:
            stalled = watch.stalled.pop(episode, None)
            if stalled is None:
                raise
            raise EpisodeStalledError(stalled) from None
        finally:
            watch.discard(episode)
            if not episode.done():
                episode.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await episode

    def _watch(self) -> EpisodeWatch:
        watch = getattr(self, "_episode_watch", None)
        if watch is None:
            watch = self._episode_watch = EpisodeWatch(self.environment_timeout_s)
        return watch

    async def _run_prompt(self, prompt: dict, sampling_params: dict, trajectory: dict, trace: bool = False) -> None:
        """verl's: run one prompt's ``rollout.n`` episodes and write the group's final status; then tell the
        admission loop, with the trajectory keys written, so that it need not list TransferQueue to find out."""
        uid = prompt["uid"]
        try:
            await super()._run_prompt(prompt, sampling_params, trajectory=trajectory, trace=trace)
        finally:
            written = self._written_keys().pop(uid, [])
            forget_group(uid)  # its answers' outputs were kept for a checkpoint until now
        if not trajectory["validate"]:  # verl's returns once the status is written (it catches its errors)
            summaries = [summary for _, summary in written if summary is not None]
            complete = len(summaries) == len(written)
            await report_settled(uid, [key for key, _ in written], summaries if complete else None)

    async def areal_save_partials(self, folder: str, index: int) -> dict[str, int]:
        """Write this worker's kept outputs into the checkpoint ``folder``: copied on the actor's event loop a batch
        at a time (no request is half-way through adding a chunk; the requests run between batches), written in a
        thread (its requests go on meanwhile)."""
        partials = await snapshot_in_flight()
        return await asyncio.to_thread(write_partials, folder, index, partials)

    async def areal_prepare_resume(self, marker: str | None, folder: str | None) -> dict[str, Any]:
        """At startup: whether this node sees the driver's ``marker`` in the checkpoint folder, and on a resume the
        kept outputs of ``folder`` this worker can read (partial_outputs.py); the indexes are read in a thread."""
        return await asyncio.to_thread(prepare_resume, marker, folder)

    def areal_end_resume(self) -> dict[str, int]:
        """After the resumed run's first step: no kept output is looked for any longer; what was continued."""
        return end_resume()

    def _written_keys(self) -> dict[str, list[tuple[str, dict[str, Any] | None]]]:
        """uid -> (key, summary) of each trajectory written for it so far."""
        return self.__dict__.setdefault("_written", {})

    async def _agent_loop_postprocess(self, output: Any, validate: bool, **kwargs: Any) -> Any:
        result = await self._postprocess_episode(output, validate, **kwargs)
        if not validate:  # verl's key scheme: "{uid}_{session_id}_{index of the episode's output}"
            outputs = output if isinstance(output, list) else [output]
            uid, session = kwargs["uid"], kwargs["session_id"]
            # Summarized here, from the outputs verl just wrote (it set their rewards): the driver need not read them.
            self._written_keys().setdefault(uid, []).extend(
                (f"{uid}_{session}_{i}", output_summary(uid, each)) for i, each in enumerate(outputs)
            )
        return result

    async def _postprocess_episode(self, output: Any, validate: bool, **kwargs: Any) -> Any:
        record = CURRENT_EPISODE.get()
        if record is not None and record.turns:
            record.finished = True  # reward and TransferQueue time is not the environment's
            outputs = output if isinstance(output, list) else [output]
            if len(outputs) != 1:
                raise ValueError(
                    f"the agent loop returned {len(outputs)} outputs for one episode; areal_async keeps per-token "
                    "versions for an episode's single output: return one AgentLoopOutput per episode"
                )
            (single,) = outputs
            trained = sum(single.response_mask)
            truncated = len(single.response_mask) >= self.rollout_config.response_length
            single.extra_fields.update(record.extra_fields(trained, truncated))
        return await super()._agent_loop_postprocess(output, validate, **kwargs)


class EpisodeWatch:
    """One timer for all of a worker's episodes: every ``CHECK_S`` (at most a quarter of the limit) it cancels
    the episodes that have been outside the engine longer than ``limit_s`` and says why in ``stalled``.
    A timer per episode woke hundreds of times a second with many episodes in flight."""

    def __init__(self, limit_s: float) -> None:
        self.limit_s = limit_s
        self.live: dict[asyncio.Task, EpisodeRecord] = {}
        self.stalled: dict[asyncio.Task, str] = {}
        self._timer: asyncio.Task | None = None

    def add(self, episode: asyncio.Task, record: EpisodeRecord) -> None:
        self.live[episode] = record
        if self._timer is None or self._timer.done():
            self._timer = asyncio.get_running_loop().create_task(self._run())

    def discard(self, episode: asyncio.Task) -> None:
        self.live.pop(episode, None)
        self.stalled.pop(episode, None)

    async def _run(self) -> None:
        while self.live:
            await asyncio.sleep(min(CHECK_S, self.limit_s / 4))
            for episode, record in list(self.live.items()):
                outside = record.seconds_outside_engine()
                if outside > self.limit_s and episode not in self.stalled and not episode.done():
                    self.stalled[episode] = (
                        f"an agent-loop episode spent {outside:.0f} s outside the engine (a tool call or environment "
                        f"step) after {record.turns} turn(s), over areal.episodes.environment_timeout_s="
                        f"{self.limit_s:g}; it fails and its group is re-issued. Fix or bound the tool, or raise the "
                        "limit"
                    )
                    episode.cancel()


class ArealAgentLoopManager(AgentLoopManagerTQ):
    """verl's ``AgentLoopManagerTQ`` with :class:`EpisodeAgentLoopWorker` workers."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.agent_loop_workers_class = ray.remote(EpisodeAgentLoopWorker)


def account_tool_calls(tool: Any) -> None:
    """Wrap a verl tool (a ``FunctionTool``'s ``call`` or a ``BaseTool``'s ``execute``) so that each call's
    latency and failure are added to the calling episode's record. verl's tool loop still sees the
    call's result or exception (it turns an exception into an error message for the model)."""
    name = "call" if hasattr(tool, "fn") else "execute"
    method = getattr(tool, name)
    if getattr(method, "_areal_accounted", False):
        return

    async def accounted(*args: Any, **kwargs: Any) -> Any:
        return await _timed(method, args, kwargs)

    accounted._areal_accounted = True  # type: ignore[attr-defined]
    setattr(tool, name, accounted)


async def _timed(method: Callable[..., Awaitable[Any]], args: tuple, kwargs: dict) -> Any:
    record = CURRENT_EPISODE.get()
    start = time.monotonic()
    try:
        result = await method(*args, **kwargs)
    except Exception:
        if record is not None:
            record.add_tool_call(time.monotonic() - start, failed=True)
        raise
    if record is not None:
        record.add_tool_call(time.monotonic() - start, failed=False)
    return result
