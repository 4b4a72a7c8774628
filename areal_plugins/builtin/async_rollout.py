"""Default sample buffer and rollout manager of the async trainer (AReaL semantics, docs/design.md, Admission)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from areal_plugins.hooks.hookimpl import hookimpl

if TYPE_CHECKING:
    from areal_plugins.config.settings import ArealConfig


def _settings(config: Any) -> ArealConfig:
    from areal_plugins.config.settings import areal_settings

    return areal_settings(config)


@hookimpl(trylast=True)
def areal_make_sample_buffer(config: Any) -> Any:
    from areal_plugins.core.buffer import OldestFirstBuffer

    settings = _settings(config)
    return OldestFirstBuffer(max_staleness=settings.max_staleness, on_stale=settings.on_stale)


@hookimpl(trylast=True)
def areal_make_rollout_manager(
    config: Any,
    buffer: Any,
    submit_prompts: Callable[[int], int],
    accept_trajectory: Callable[[Any], bool],
    reissue_prompts: Callable[[list[str]], None],
) -> Any:
    import transfer_queue

    from areal_plugins.actors.settled_groups import drain_reports, start_inbox
    from areal_plugins.core.staleness import StalenessController
    from areal_plugins.core.trajectory import keep_every_trajectory
    from areal_plugins.driver.admission import AdmissionLoop

    settings = _settings(config)
    # With no plugin to ask, settled groups need not be read back: their workers' reports say what is recorded.
    accept = None if accept_trajectory is keep_every_trajectory else accept_trajectory
    inbox = start_inbox()  # our agent-loop workers report each settled group to it
    batch = int(config.data.train_batch_size)  # η and B count prompt groups: GRPO groups stay together
    staleness_controller = StalenessController(
        max_staleness=settings.max_staleness,
        batch_size=batch,
        max_concurrent=settings.concurrent_rollouts(batch),
    )
    return AdmissionLoop(
        staleness_controller,
        buffer,
        submit_prompts,
        accept,
        settings.poll_interval_s,
        store=transfer_queue,
        failure_limit=2 * batch,  # two batches' worth of failures in a row, none finished: not a fluke
        reissue=reissue_prompts,
        settled_reports=lambda: drain_reports(inbox),
    )
