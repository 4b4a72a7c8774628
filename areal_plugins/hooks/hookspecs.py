"""Hook specifications of areal_plugins, in lifecycle order (startup → rollout → training → shutdown).

Specs only: implementations live in ``areal_plugins/builtin/`` (``trylast`` defaults) and in
third-party plugins registered through the ``areal_plugins`` entry-point group. Every hook here is
listed with its exact signature in ``docs/hooks.md`` (a test enforces it), says since which version it
exists (``Since:``), and is called through its typed method of :class:`areal_plugins.plugin_manager.Hooks`.

``config`` means one thing per hook, by where the hook runs: the whole composed recipe (an OmegaConf
``DictConfig``) on the driver; the ``{"areal": ...}`` mapping a reward worker receives; None in a trainer
worker, which has no recipe (deprecated there: ``areal_make_policy_loss``). The objects the rollout
hooks return are typed by the Protocols of :mod:`areal_plugins.hooks.contracts`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping

    from omegaconf import DictConfig

    from areal_plugins.core.trajectory import Trajectory
    from areal_plugins.hooks.contracts import RolloutManager, SampleBuffer

PROJECT_NAME = "areal_plugins"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)


# ---------------------------------------------------------------- startup


@hookspec
def areal_validate_config(config: DictConfig) -> None:
    """Check the ``areal:`` settings before anything starts; raise ``ValueError`` to refuse them.

    The return value is ignored; raise with a message naming the YAML path to change.

    :param config: the whole composed recipe (verl's config with our ``areal:`` node).

    Called from: verl's TaskRunner (the trainer's driver, a Ray actor), when the trainer initialises,
    before any worker starts (``areal_plugins.driver.hooked.HookedTrainerMixin.init``).
    Default: ``areal_plugins.builtin.validation``: refuses combinations of ``areal:`` and verl settings
    that cannot work (single fields validate themselves in ``areal_plugins.config.settings``).
    Since: 0.1.0.
    """


@hookspec(firstresult=True)
def areal_make_sample_buffer(config: DictConfig) -> SampleBuffer | None:
    """Create the buffer that holds finished, accepted rollout groups until the trainer takes them.

    Return the buffer (the :class:`~areal_plugins.hooks.contracts.SampleBuffer` contract, checked at
    startup; ``areal_plugins.testing.check_sample_buffer`` checks its behaviour), or None to let the next
    implementation decide.

    :param config: the composed recipe (``config.areal`` holds our settings).

    Called from: verl's TaskRunner (the driver), when the async trainer starts training
    (``on_train_begin``), just before ``areal_make_rollout_manager``.
    Default: ``areal_plugins.builtin.async_rollout``: :class:`~areal_plugins.core.buffer.OldestFirstBuffer`,
    oldest head version first, ``areal.on_stale`` applied.
    Since: 0.1.0.
    """


@hookspec(firstresult=True)
def areal_make_rollout_manager(
    config: DictConfig,
    buffer: SampleBuffer,
    submit_prompts: Callable[[int], int],
    accept_trajectory: Callable[[Trajectory], bool],
    reissue_prompts: Callable[[list[str]], None],
) -> RolloutManager | None:
    """Create the manager that admits rollouts within the staleness bound and fills ``buffer``.

    Return the manager (the :class:`~areal_plugins.hooks.contracts.RolloutManager` contract, its
    ``staleness_controller`` the :class:`~areal_plugins.hooks.contracts.StalenessControllerLike` one; both checked
    at startup), or None to defer.

    :param config: the composed recipe.
    :param buffer: what ``areal_make_sample_buffer`` returned.
    :param submit_prompts: submits exactly ``n`` new prompt groups for generation and returns ``n``; it raises
        rather than send fewer (the default manager counts ``n`` submitted before the call, and takes them back
        if it raises).
    :param accept_trajectory: asks every ``areal_accept_trajectory`` implementation about one finished
        :class:`~areal_plugins.core.trajectory.Trajectory`; False means drop it (its slot is freed). With no
        implementation installed it is :func:`~areal_plugins.core.trajectory.keep_every_trajectory` itself,
        and a manager may then skip reading trajectories back.
    :param reissue_prompts: sends prompt groups that failed (by uid) for generation again; their prompt
        stays registered in TransferQueue meanwhile, so a checkpoint keeps it. A manager that drops
        failed groups instead loses their prompts.

    Called from: verl's TaskRunner (the driver), when the async trainer starts training.
    Default: ``areal_plugins.builtin.async_rollout``: :class:`AdmissionLoop` with
    :class:`~areal_plugins.core.staleness.StalenessController` (docs/design.md, Admission).
    Since: 0.1.0.
    """


@hookspec(firstresult=True)
def areal_make_reward_fn(config: Mapping[str, Any]) -> Callable[..., float] | None:
    """Return the reward function ``(data_source, solution_str, ground_truth, extra_info) -> float``.

    Return None to let the next implementation decide.

    :param config: ``{"areal": {"enable": ..., "plugins": ...}}``: the settings the reward worker
        receives through ``reward.custom_reward_function.reward_kwargs`` (it has no other config).

    Called from: each reward worker process, once, on its first reward
    (``areal_plugins.rewards.hooked.compute_score``, the recipes' custom reward function); never when
    ``areal.enable`` is false.
    Default: ``builtin.rewards``: the math-verify exact-answer reward (``trylast``).
    Since: 0.1.0.
    """


@hookspec(
    firstresult=True,
    warn_on_impl_args={
        "config": DeprecationWarning(
            "areal_make_policy_loss(config): the config argument is deprecated (it is always None) and will be "
            "removed in a later release: declare the hook without it, `def areal_make_policy_loss():`"
        )
    },
)
def areal_make_policy_loss(config: None) -> Callable[..., Any] | None:
    """Return the policy loss the trainer optimises, or None to let the next implementation decide.

    The function takes the arguments of :func:`areal_plugins.core.losses.decoupled_ppo_loss`
    (``logprobs, proximal_logprobs, behav_logprobs, advantages, loss_mask, **clip/cap options``) and
    returns ``(token-mean loss, stats)``; verl's global-batch weighting is applied around it.

    :param config: deprecated, always None (trainer workers have no recipe; ``areal.loss`` reaches the loss through
        verl): declare the hook without it. An implementation that still declares it works, and its registration
        warns (``DeprecationWarning``, pluggy's ``warn_on_impl_args``).

    Called from: each trainer worker process, once, at its first loss computation with the policy
    losses ``areal_decoupled`` / ``areal_decoupled_loglinear`` (``areal.enable: true``).
    Default: ``builtin.losses``: the decoupled PPO objective (``trylast``).
    Since: 0.1.0.
    """


# ---------------------------------------------------------------- rollout


@hookspec(firstresult=True)
def areal_accept_trajectory(trajectory: Trajectory) -> bool | None:
    """Decide whether a finished, scored trajectory is kept for training.

    Return False to reject it (its staleness slot is freed and it is counted as rejected), True to
    keep it and stop asking further plugins, None to defer (kept if nobody rejects). Implementing it
    has a cost in verl's driver: every finished trajectory is then read back from TransferQueue to be
    shown to it; with no implementation installed, none is (the workers report what the run records).

    :param trajectory: the finished trajectory, reward set. For an episode of several turns (verl's
        ``tool_agent`` loop or your own agent loop) it is the whole episode: ``prompt_ids`` the first
        prompt; ``response_ids``, ``behav_logprobs`` and ``versions`` the tokens the model generated in
        every turn, in order (tool and environment tokens, masked out of the loss, are left out, so
        ``versions[i]`` is the version that generated ``response_ids[i]``); ``head_version`` the oldest
        generated token's version, which staleness is judged by; ``reward`` the episode's. ``extra``
        holds verl's extra fields of the episode plus ours: ``areal_turns``, ``areal_turn_tokens``
        (generated tokens per turn, so ``versions`` splits into turns), ``num_interrupts`` (weight
        updates that interrupted a turn), ``areal_updates_between_turns``, ``areal_tool_calls``,
        ``areal_tool_failures``, ``areal_tool_seconds`` (docs/multi_turn.md).

    Called from: the rollout manager on the driver, once per finished trajectory of the async
    trainer (``areal.mode: async``). A GRPO group is kept with its remaining members and rejected
    as a whole (slot freed) only when every member is rejected.
    Default: none (every trajectory is kept).
    Since: 0.1.0.
    """


@hookspec
def areal_before_weight_update(version: int) -> None:
    """Observe that generation is about to pause for weights of ``version``. Return value ignored.

    :param version: the version about to be loaded.

    Called from: verl's TaskRunner in the async trainer, after the step trained, before the weights are
    sent. Where the engines stand then depends on the placement: ``colocated`` engines were already
    interrupted and put to sleep when sampling ended (they share the trainer's devices), and admission is
    paused; ``separate`` engines are still generating (and, unless the run is a replay, admission is still
    open): a staging checkpoint engine (``areal_gloo``) transfers the weights first and stops admission and
    the engines only to load them; verl's others (``nccl``) stop both as the transfer starts.
    Default: none.
    Since: 0.1.0.
    """


@hookspec
def areal_on_weights_updated(version: int) -> None:
    """Observe that every rollout engine now serves ``version``. Return value ignored.

    :param version: the policy version the engines serve from now on.

    Called from: verl's TaskRunner, after verl's weight sync returned (each engine has confirmed the
    version and checksum it loaded): once for the initial sync, then after every step.
    Default: none.
    Since: 0.1.0.
    """


# ---------------------------------------------------------------- training


@hookspec
def areal_after_train_step(step: int, metrics: dict[str, Any]) -> None:
    """Observe a finished optimizer step; add entries to ``metrics`` to log them. Return value ignored.

    :param step: the trainer's global step just completed (1-based).
    :param metrics: the step's metrics, mutable; keys are namespaced (``areal/...``).

    Called from: verl's TaskRunner, after each step's metrics are computed, before verl logs them: after
    the step's actor update, its checkpoint (when due), its weight sync to the engines (every step syncs,
    the last included) and its validation (when due).
    Default: none.
    Since: 0.1.0.
    """


# ---------------------------------------------------------------- shutdown


@hookspec
def areal_on_shutdown(reason: str) -> None:
    """Observe the end of a run. Return value ignored.

    :param reason: ``"completed"``, ``"error"`` or ``"interrupted"`` (Ctrl-C or SIGTERM to ``areal-plugins train``,
        whether the run stopped at once or between two steps).

    Called from: verl's TaskRunner, once, as the trainer's ``fit`` returns or raises, after the async trainer
    stopped admitting trajectories: no other hook of the run follows it.
    Default: none.
    Since: 0.1.0.
    """
