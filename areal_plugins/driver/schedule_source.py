"""What decides which groups each step trains and when a weight version's requests are done: the live run, or a record.

The async trainer asks its schedule source at the points where a replay differs from a live run, instead of branching
on whether it replays: which rollout client the agent loop uses, which buffer the trainer draws from, what to do when
the engines start serving a version and when a version ends, and what to check after a step.
:class:`LiveSchedule` is a live run (every answer is a no-op or the default); the replay's is
:class:`areal_plugins.replay.driver_side.ReplayDriver`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol


class ScheduleSource(Protocol):
    #: True: admission stops before each weight update (a replay's barrier needs it), even where the sync could
    #: stop it later, just before the abort (``weight_sync/staged.py``).
    pauses_admission_before_update: bool

    def client_class(self) -> type:
        """The rollout client class verl's agent-loop workers build (verl's ``get_llm_client``)."""
        ...

    def sample_buffer(self, config: Any) -> Any:
        """The buffer the trainer draws its batches from."""
        ...

    def served(self, version: int) -> None:
        """The engines serve ``version`` from now on."""
        ...

    def finish_version(self, version: int, check: Callable[[], None]) -> None:
        """Return once the requests that must run under ``version`` have run (``check`` raises if the run cannot go
        on)."""
        ...

    def check_step(self, step: int, metrics: dict[str, Any]) -> None:
        """After a step's metrics are computed."""
        ...


class LiveSchedule:
    """A live run: the admission loop and the engines decide; the buffer is the ``areal_make_sample_buffer`` hook's."""

    pauses_admission_before_update = False

    def client_class(self) -> type:
        from areal_plugins.agent_loop.llm_client import InterruptibleLLMClient

        return InterruptibleLLMClient

    def sample_buffer(self, config: Any) -> Any:
        from areal_plugins.plugin_manager import HOOKS

        return HOOKS.make_sample_buffer(config=config)

    def served(self, version: int) -> None:
        pass

    def finish_version(self, version: int, check: Callable[[], None]) -> None:
        pass

    def check_step(self, step: int, metrics: dict[str, Any]) -> None:
        pass
