"""What one agent-loop episode did across its turns: versions of every generated token, interrupts, tools.

An episode is one run of a verl agent loop: one or more ``generate`` calls (assistant turns) with
tool or environment messages between them. verl's agent loops merge the extra fields of the first
turn only (``tool_agent_loop`` updates just ``max_global_steps`` afterwards), so the versions of later
turns would be lost; instead our rollout client adds every turn to the :class:`EpisodeRecord` of the
episode it runs in (a context variable, set per agent-loop task by
:mod:`areal_plugins.agent_loop.episode_workers`), and the record's fields replace the loop's before
the trajectory goes to TransferQueue. Nothing here imports verl.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from areal_plugins.core.trajectory_rows import CHUNKS_FIELD

#: The episode the current agent-loop task runs (None outside one, e.g. in unit tests of the client).
CURRENT_EPISODE: ContextVar[EpisodeRecord | None] = ContextVar("areal_current_episode", default=None)


class EpisodeAlignmentError(RuntimeError):
    """An episode's trainable tokens and its generated tokens do not line up."""


@dataclass
class EpisodeRecord:
    """The generated tokens' versions and the turn, interrupt and tool counts of one episode.

    ``versions`` lists the generating policy version of every generated token in order, turn after
    turn: exactly the tokens verl marks 1 in ``response_mask`` (tool and environment tokens are 0 and
    carry no version).
    """

    versions: list[int] = field(default_factory=list)
    #: ``[first generated token, version, seed]`` of each request, indices counted over the episode's generated tokens
    chunks: list[list[Any]] = field(default_factory=list)
    turn_tokens: list[int] = field(default_factory=list)
    interrupts_within_turns: int = 0
    updates_between_turns: int = 0
    tool_calls: int = 0
    tool_failures: int = 0
    tool_seconds: float = 0.0
    #: monotonic time since which the episode has been outside the engine (None while generating).
    outside_engine_since: float | None = field(default_factory=time.monotonic)
    finished: bool = False
    #: verl's prompt uid and answer index of the episode (``uid``, ``session_id``), when the worker knows them
    group_uid: str | None = None
    session: int | None = None
    #: the episode answers a prompt of verl's validation (``trajectory["validate"]``): its requests go first
    validation: bool = False

    # ------------------------------------------------------------------ written by the rollout client

    def enter_engine(self) -> None:
        self.outside_engine_since = None

    def add_turn(self, versions: list[int], interrupts: int, chunks: Sequence[Sequence[Any]] = ()) -> None:
        """One ``generate`` call's generated tokens (their versions), how often it was interrupted and its requests
        (``[first token, version, seed]``, first token counted within the call)."""
        if versions and self.versions and versions[0] > self.versions[-1]:
            # New weights arrived between this turn's first token and the previous turn's last one:
            # while the episode was in a tool call, or queued for its next turn.
            self.updates_between_turns += 1
        self.chunks.extend([start + len(self.versions), version, seed] for start, version, seed in chunks)
        self.versions.extend(versions)
        self.turn_tokens.append(len(versions))
        self.interrupts_within_turns += interrupts
        self.outside_engine_since = time.monotonic()

    # ------------------------------------------------------------------ written by the tool wrapper

    def add_tool_call(self, seconds: float, failed: bool) -> None:
        self.tool_calls += 1
        self.tool_seconds += seconds
        self.tool_failures += int(failed)

    # ------------------------------------------------------------------ read by the episode's worker

    def seconds_outside_engine(self, now: float | None = None) -> float:
        """How long the episode has been in its own code (tools, environment) since it last generated."""
        if self.outside_engine_since is None or self.finished:
            return 0.0
        return (time.monotonic() if now is None else now) - self.outside_engine_since

    @property
    def turns(self) -> int:
        return len(self.turn_tokens)

    def extra_fields(self, trained_tokens: int, truncated: bool) -> dict[str, Any]:
        """The trajectory's version and episode fields, for ``trained_tokens`` tokens marked 1 in its mask.

        ``truncated``: verl cut the response at ``response_length``, so fewer tokens than generated
        may be marked; otherwise both counts must agree, or versions would land on the wrong tokens.
        """
        generated = len(self.versions)
        if trained_tokens > generated or (not truncated and trained_tokens != generated):
            raise EpisodeAlignmentError(
                f"the episode generated {generated} tokens over {self.turns} turn(s) but its response_mask marks "
                f"{trained_tokens} tokens as generated; per-token versions cannot be aligned. The agent loop or its "
                "token builder edits generated tokens (verl's continuous-token builders may trim them): use one that "
                "keeps the engine's tokens as they came"
            )
        return {
            **version_fields(self.versions[:trained_tokens]),
            "num_interrupts": self.interrupts_within_turns,
            CHUNKS_FIELD: [chunk for chunk in self.chunks if chunk[0] < trained_tokens],
            "areal_turns": self.turns,
            "areal_turn_tokens": list(self.turn_tokens),
            "areal_updates_between_turns": self.updates_between_turns,
            "areal_tool_calls": self.tool_calls,
            "areal_tool_failures": self.tool_failures,
            "areal_tool_seconds": self.tool_seconds,
        }


def version_fields(versions: list[int]) -> dict[str, Any]:
    """``token_versions`` and, when any token was generated, the head and tail version under the names verl
    copies into the trajectory's TransferQueue tags (``min_global_steps`` / ``max_global_steps``)."""
    fields: dict[str, Any] = {"token_versions": versions}
    if versions:
        fields.update(min_global_steps=min(versions), max_global_steps=max(versions))
    return fields
