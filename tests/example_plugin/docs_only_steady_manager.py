"""A third party's rollout manager, written from docs/guides/plugins.md ("Replace the sample buffer or the
rollout manager") alone: the default admission, but at most ``PER_POLL`` groups submitted per poll, so that a
new weight version does not send a whole batch to the engines at once. It wraps the default and forwards every
member of the documented contract by hand (a member the guide forgot would make the trainer refuse it).
Opt-in: a run loads it only with ``areal.plugins.include: [steady_manager]``.

If ``AREAL_STEADY_MANAGER_LOG`` names a file, every submission appends a line ``{"count": n}`` to it.
"""

from __future__ import annotations

import json
import os

import pluggy

from areal_plugins import AdmissionLoop, ArealConfig, StalenessController

AREAL_PLUGIN_OPT_IN = True
PER_POLL = 4
hookimpl = pluggy.HookimplMarker("areal_plugins")


class SteadyController(StalenessController):
    def capacity(self, version):
        return min(super().capacity(version), PER_POLL)


class SteadyManager:
    def __init__(self, loop: AdmissionLoop) -> None:
        self._loop = loop

    # the counts and counters
    @property
    def staleness_controller(self):
        return self._loop.staleness_controller

    @property
    def last_progress(self):
        return self._loop.last_progress

    @property
    def failed_groups(self):
        return self._loop.failed_groups

    @property
    def reissued_groups(self):
        return self._loop.reissued_groups

    @property
    def reissued_stale_groups(self):
        return self._loop.reissued_stale_groups

    @property
    def dropped_stale_groups(self):
        return self._loop.dropped_stale_groups

    @property
    def rejected_trajectories(self):
        return self._loop.rejected_trajectories

    # the calls
    def start(self):
        self._loop.start()

    def stop(self):
        self._loop.stop()

    def pause(self):
        self._loop.pause()

    def resume(self, version):
        self._loop.resume(version)

    def suspend_polling(self):
        self._loop.suspend_polling()

    def quiesce(self):
        return self._loop.quiesce()

    def check_alive(self):
        self._loop.check_alive()

    def drop_stale(self, groups):
        self._loop.drop_stale(groups)

    def reissue_stale(self, groups):
        self._loop.reissue_stale(groups)


def build_manager(
    eta, batch, buffer, submit_prompts, accept_trajectory, reissue_prompts, store, poll_interval_s, max_concurrent=None
):
    log = os.environ.get("AREAL_STEADY_MANAGER_LOG")

    def submit(count):
        if log:
            with open(log, "a") as handle:
                handle.write(json.dumps({"count": count}) + "\n")
        return submit_prompts(count)

    staleness_controller = SteadyController(
        max_staleness=eta, batch_size=batch, max_concurrent=max_concurrent or (eta + 1) * batch
    )
    loop = AdmissionLoop(
        staleness_controller,
        buffer,
        submit,
        accept_trajectory,
        poll_interval_s,
        store=store,
        failure_limit=2 * batch,
        reissue=reissue_prompts,
    )
    return SteadyManager(loop)


@hookimpl
def areal_make_rollout_manager(config, buffer, submit_prompts, accept_trajectory, reissue_prompts):
    import transfer_queue

    settings = ArealConfig.from_node(config.areal)
    return build_manager(
        settings.max_staleness,
        int(config.data.train_batch_size),
        buffer,
        submit_prompts,
        accept_trajectory,
        reissue_prompts,
        transfer_queue,
        settings.poll_interval_s,
        settings.max_concurrent_rollouts,
    )
