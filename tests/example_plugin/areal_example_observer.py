"""An example third-party plugin, installed only through the ``areal_plugins`` entry-point group.

It records the lifecycle hooks it sees to ``$AREAL_EXAMPLE_OBSERVER_LOG`` (JSON lines) and adds a
metric to every step; with ``AREAL_EXAMPLE_OBSERVER_MIN_REWARD`` set it rejects finished trajectories
scoring below it; with ``AREAL_EXAMPLE_OBSERVER_RAISE`` set it fails inside a hook, to show how a
broken plugin stops a run; with ``AREAL_EXAMPLE_OBSERVER_LOSS_FAILS_AFTER=N`` its policy loss (in the
trainer workers) raises from its N+1-th call on, to show a trainer worker's error stopping a run (with
``AREAL_EXAMPLE_OBSERVER_LOSS_HANGS_AFTER=N`` it never returns instead: a hung worker; with
``AREAL_EXAMPLE_OBSERVER_LOSS_FAILS_ONCE=path`` as well, it raises (or hangs) only if that file does not exist
yet, and makes it: a fault that a restarted run does not meet again); with
``AREAL_EXAMPLE_OBSERVER_REWARD=quarter`` its reward function scores everything 0.25; with
``AREAL_EXAMPLE_OBSERVER_EPISODES=path`` it writes every finished trajectory as the accept hook sees
it (trained tokens, their versions, the episode's turns) to that file.
The integration tests put this folder on ``PYTHONPATH``.
"""

from __future__ import annotations

import json
import os
import time

from areal_plugins import hookimpl

LOG_ENV = "AREAL_EXAMPLE_OBSERVER_LOG"
RAISE_ENV = "AREAL_EXAMPLE_OBSERVER_RAISE"
MIN_REWARD_ENV = "AREAL_EXAMPLE_OBSERVER_MIN_REWARD"
LOSS_FAILS_AFTER_ENV = "AREAL_EXAMPLE_OBSERVER_LOSS_FAILS_AFTER"
LOSS_HANGS_AFTER_ENV = "AREAL_EXAMPLE_OBSERVER_LOSS_HANGS_AFTER"
LOSS_FAILS_ONCE_ENV = "AREAL_EXAMPLE_OBSERVER_LOSS_FAILS_ONCE"
REWARD_ENV = "AREAL_EXAMPLE_OBSERVER_REWARD"
EPISODES_ENV = "AREAL_EXAMPLE_OBSERVER_EPISODES"


def _record(event: str, **fields: object) -> None:
    path = os.environ.get(LOG_ENV)
    if path:
        with open(path, "a") as handle:
            handle.write(json.dumps({"event": event, **fields}) + "\n")


@hookimpl
def areal_accept_trajectory(trajectory):
    episodes = os.environ.get(EPISODES_ENV)
    if episodes:
        extra = trajectory.extra
        fields = (
            "areal_turn_tokens",
            "num_interrupts",
            "areal_updates_between_turns",
            "areal_tool_calls",
            "areal_chunks",
        )
        with open(episodes, "a") as handle:
            record = {
                "group": trajectory.group_id,
                "response_ids": trajectory.response_ids,
                "versions": trajectory.versions,
                "episode": extra.get("test_episode_id"),
                **{key: extra.get(key) for key in fields},
            }
            handle.write(json.dumps(record) + "\n")
    threshold = os.environ.get(MIN_REWARD_ENV)
    if threshold is None:
        return None
    keep = trajectory.reward is not None and trajectory.reward >= float(threshold)
    _record("accept_trajectory", reward=trajectory.reward, head_version=trajectory.head_version, kept=keep)
    return keep


@hookimpl
def areal_before_weight_update(version):
    _record("before_weight_update", version=version, time=time.time())


@hookimpl
def areal_on_weights_updated(version):
    _record("weights_updated", version=version, time=time.time())


@hookimpl
def areal_after_train_step(step, metrics):
    if os.environ.get(RAISE_ENV):
        raise RuntimeError("the example observer was told to fail")
    metrics["example_observer/step_seen"] = step
    _record("after_train_step", step=step)


@hookimpl
def areal_on_shutdown(reason):
    _record("shutdown", reason=reason)


@hookimpl
def areal_make_policy_loss():
    _record("make_policy_loss", pid=os.getpid())  # in a trainer worker process
    fails, hangs = os.environ.get(LOSS_FAILS_AFTER_ENV), os.environ.get(LOSS_HANGS_AFTER_ENV)
    if fails is None and hangs is None:
        return None
    import time

    from areal_plugins.core.losses import decoupled_ppo_loss

    calls = {"n": 0}
    limit = int(fails if fails is not None else hangs)

    def first_failure() -> bool:
        marker = os.environ.get(LOSS_FAILS_ONCE_ENV)
        if marker is None:
            return True
        try:
            with open(marker, "x"):  # exclusive create: one failure in all processes and attempts
                return True
        except FileExistsError:
            return False

    def failing_after_a_while(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] > limit and first_failure():
            if fails is not None:
                raise FloatingPointError(f"example observer: loss call {calls['n']} hit a NaN (deliberate)")
            while True:  # hangs (deliberate)
                time.sleep(3600)
        return decoupled_ppo_loss(*args, **kwargs)

    return failing_after_a_while


def quarter_reward(data_source, solution_str, ground_truth, extra_info):
    """A third-party reward (module-level: the reward service sends it to its worker processes)."""
    _record("reward", pid=os.getpid(), solution=solution_str)
    return 0.25


@hookimpl
def areal_make_reward_fn(config):
    _record("make_reward_fn", pid=os.getpid())  # in a reward worker process
    return quarter_reward if os.environ.get(REWARD_ENV) == "quarter" else None
