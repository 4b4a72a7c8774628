"""Our lifecycle hooks around verl's own trainers (``areal_sync``; ``areal_async`` reuses the mixin).

The trainers run in verl's TaskRunner process, where the whole composed recipe is available.
"""

from __future__ import annotations

import logging
from typing import Any

from areal_plugins.manager import call_hook, configure_plugins
from areal_plugins.trainers.workers import run_in_workers

logger = logging.getLogger(__name__)


class HookedTrainerMixin:
    """Calls the hooks of ``hookspecs`` at verl's trainer lifecycle points.

    Weight updates reach the engines in verl's ``on_init_end`` (initial sync) and ``on_step_end``
    (after each step), so ``areal_on_weights_updated`` follows those; ``_compute_metrics`` runs just
    before verl logs a step, so plugins can add metrics in ``areal_after_train_step``.
    """

    config: Any
    global_steps: int

    def init(self) -> None:
        plugins = self.config.areal.plugins
        include = list(plugins.include) if plugins.include is not None else None
        manager = configure_plugins(include=include, exclude=list(plugins.exclude))
        logger.info("areal_plugins: plugins %s", [name for name, _ in manager.list_name_plugin()])
        call_hook("areal_validate_config", config=self.config)
        super().init()  # type: ignore[misc]
        from areal_plugins.patches import apply_in_workers

        workers = [self.actor_rollout_wg]  # type: ignore[attr-defined]
        # The trainer workers call areal_make_policy_loss: give them the driver's plugin set.
        run_in_workers(workers, configure_plugins, include, list(plugins.exclude))
        applied = apply_in_workers(self.config, workers)
        if applied:
            logger.info("areal_plugins: applied %s in the trainer's worker processes", applied)

    def on_init_end(self) -> None:
        super().on_init_end()  # type: ignore[misc]
        call_hook("areal_on_weights_updated", version=self.global_steps)

    def on_step_end(self) -> None:
        super().on_step_end()  # type: ignore[misc]
        call_hook("areal_on_weights_updated", version=self.global_steps)

    def _compute_metrics(self, batch: Any, metrics: dict, timing_raw: dict, global_steps: int, epoch: int) -> Any:
        result = super()._compute_metrics(batch, metrics, timing_raw, global_steps, epoch)  # type: ignore[misc]
        call_hook("areal_after_train_step", step=global_steps, metrics=metrics)
        return result

    def fit(self, agent_loop_manager: Any) -> None:
        reason = "error"
        try:
            super().fit(agent_loop_manager)  # type: ignore[misc]
            reason = "completed"
        except KeyboardInterrupt:
            reason = "interrupted"
            raise
        finally:
            call_hook("areal_on_shutdown", reason=reason)
