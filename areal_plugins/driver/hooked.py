"""Our lifecycle hooks around verl's own trainers (``areal_sync``; ``areal_async`` reuses the mixin).

The trainers run in verl's TaskRunner process, where the whole composed recipe is available.
"""

from __future__ import annotations

import logging
from typing import Any

from areal_plugins.config.routing import pin_plugin_selection
from areal_plugins.config.settings import areal_settings
from areal_plugins.driver.length_order import order_batch_by_length, pads_micro_batches
from areal_plugins.driver.worker_calls import apply_patches_in_workers, run_in_workers
from areal_plugins.plugin_manager import HOOKS, configure_plugins, selected_plugin_names
from areal_plugins.records.control_files import RunStoppedOnRequestError

logger = logging.getLogger(__name__)

__all__ = ["HookedTrainerMixin", "pin_plugin_selection"]


class HookedTrainerMixin:
    """Calls the hooks of ``hookspecs`` at verl's trainer lifecycle points.

    Weight updates reach the engines in verl's ``on_init_end`` (initial sync) and ``on_step_end``
    (after each step), so ``areal_on_weights_updated`` follows those; ``_compute_metrics`` runs just
    before verl logs a step, so plugins can add metrics in ``areal_after_train_step``. After verl
    balances a batch across ranks, padded micro-batches get it ordered by length (length_order.py).
    """

    config: Any
    global_steps: int
    _plugin_include: Any  # the driver's plugin selection, for the workers (set in init, sent in _setup)

    def init(self) -> None:
        from areal_plugins.rollout.server_slots import bound_requests_from_config, bound_requests_in_flight

        # Before the servers are built: each gets a slot for every request in flight, plus control slots.
        bound_requests_in_flight(bound_requests_from_config(self.config))
        if str(self.config.actor_rollout_ref.rollout.name) == "vllm":  # our checked server, in areal_sync too
            from areal_plugins.rollout.verl_vllm.server import use_checked_vllm_replicas

            use_checked_vllm_replicas(self.config.actor_rollout_ref.rollout)
        plugins = areal_settings(self.config).plugins
        # "All installed" means the driver's machine's plugins: every worker, on any node, loads these.
        include = pin_plugin_selection(self.config, selected_plugin_names(plugins.include, list(plugins.exclude or [])))
        manager = configure_plugins(include=include, exclude=[])
        logger.info("areal_plugins: plugins %s", [name for name, _ in manager.list_name_plugin()])
        HOOKS.validate_config(config=self.config)
        self._size_reward_scorers()  # before verl's reward workers are made from the config
        self._plugin_include = include
        super().init()  # type: ignore[misc]

    def _setup(self) -> None:
        """verl builds the workers here; its ``on_init_end`` (the first weight sync) runs next, so what the
        workers need from the recipe reaches them now (a patch of the weight sync applies to the first one too)."""
        super()._setup()  # type: ignore[misc]
        workers = [self.actor_rollout_wg]  # type: ignore[attr-defined]
        # The trainer workers call areal_make_policy_loss: give them the driver's plugin set.
        run_in_workers(workers, configure_plugins, self._plugin_include, [])
        applied = apply_patches_in_workers(self.config, workers)
        if applied:
            logger.info("areal_plugins: applied %s in the trainer's worker processes", applied)

    def _size_reward_scorers(self) -> None:
        """Our reward's scoring processes per verl reward worker, from the batch and the cluster's CPUs (unless
        ``areal.reward.num_workers`` sets them): written where the reward workers read it, and logged."""
        from areal_plugins.driver.limits import cluster_cpus, scorer_line, size_reward_scorers

        cpus = cluster_cpus()
        if cpus is not None:
            size_reward_scorers(self.config, *cpus)
        logger.info("areal: %s", scorer_line(self.config, *(cpus or (None, None))))

    def on_init_end(self) -> None:
        super().on_init_end()  # type: ignore[misc]
        HOOKS.on_weights_updated(version=self.global_steps)

    def on_step_end(self) -> None:
        super().on_step_end()  # type: ignore[misc]
        HOOKS.on_weights_updated(version=self.global_steps)

    def _compute_metrics(self, batch: Any, metrics: dict, timing_raw: dict, global_steps: int, epoch: int) -> Any:
        result = super()._compute_metrics(batch, metrics, timing_raw, global_steps, epoch)  # type: ignore[misc]
        HOOKS.after_train_step(step=global_steps, metrics=metrics)
        return result

    def _balance_batch(
        self, batch: Any, metrics: dict, logging_prefix: str = "global_seqlen", keep_minibatch: bool = False
    ) -> Any:
        batch = super()._balance_batch(batch, metrics, logging_prefix, keep_minibatch)  # type: ignore[misc]
        if not pads_micro_batches(self.config):
            return batch
        dp_size = max(self.actor_rollout_wg._dispatch_info["actor"]) + 1  # type: ignore[attr-defined]  # verl's
        return order_batch_by_length(batch, self.config, dp_size, metrics)

    def fit(self, agent_loop_manager: Any) -> None:
        reason = "error"
        try:
            super().fit(agent_loop_manager)  # type: ignore[misc]
            reason = "completed"
        except (KeyboardInterrupt, RunStoppedOnRequestError):  # Ctrl-C, at once or between two steps
            reason = "interrupted"
            raise
        finally:
            try:
                self.stop_rollout()
            finally:
                HOOKS.on_shutdown(reason=reason)

    def stop_rollout(self) -> None:
        """End whatever still generates or admits beside the trainer: the shutdown hook is the last call."""
