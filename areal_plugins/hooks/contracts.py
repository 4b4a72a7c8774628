"""What the async trainer requires of the objects the rollout hooks return, as ``typing.Protocol``s.

``areal_make_sample_buffer`` returns a :class:`SampleBuffer`; ``areal_make_rollout_manager`` returns a
:class:`RolloutManager`, whose ``staleness_controller`` is a :class:`StalenessControllerLike`;
``areal_make_reward_fn`` returns a :class:`RewardFunction`, ``areal_make_policy_loss`` a :class:`PolicyLoss`; a rollout
backend's server class has the members of :class:`BackendCapabilities`. These are the whole contract:
the trainer calls nothing else on them, and checks at startup that an object returned by a plugin has every
member (:func:`missing_members`), naming what is missing. ``areal_plugins.testing`` checks behaviour too
(the conformance kit, docs/guides/plugins.md). The defaults: :class:`areal_plugins.core.buffer.OldestFirstBuffer`,
:class:`areal_plugins.driver.admission.AdmissionLoop` and
:class:`areal_plugins.core.staleness.StalenessController`.
"""

from __future__ import annotations

import inspect
import warnings
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from areal_plugins._moved import renamed

if TYPE_CHECKING:
    from areal_plugins.core.buffer import BufferedGroup


@runtime_checkable
class SampleBuffer(Protocol):
    """Finished, accepted rollout groups, held until the trainer takes them."""

    #: Groups handed out by :meth:`take` although older than η (``on_stale: wait``), since the start.
    over_stale_kept: int

    def put(self, group: BufferedGroup) -> None:
        """Hold ``group`` (called from the admission thread; the buffer must be thread-safe)."""

    def take(
        self, count: int, trainer_version: int, timeout: float | None = None
    ) -> tuple[list[BufferedGroup], list[BufferedGroup]]:
        """Wait up to ``timeout`` s for ``count`` groups; return ``(taken, stale)``.

        ``taken``: exactly ``count`` groups, or none when the timeout passed first (then nothing is removed).
        ``stale``: groups removed because they are past η at ``trainer_version`` and the buffer does not keep
        such groups; the trainer hands them to the manager (dropped or generated again). Return as soon as
        there are stale groups, so that their slots are freed without waiting.
        """
        ...

    def __len__(self) -> int:
        """Groups held now."""
        ...


@runtime_checkable
class StalenessControllerLike(Protocol):
    """The staleness bound's counts of rollout groups (docs/design.md, Admission): what a manager's
    ``staleness_controller`` has (the default: :class:`areal_plugins.core.staleness.StalenessController`).

    Called ``AdmissionCounters`` before 0.1.0; that name still imports, with a ``DeprecationWarning``.
    """

    @property
    def running(self) -> int:
        """Groups submitted and not yet settled."""
        ...

    @property
    def accepted(self) -> int:
        """Groups accepted since the start (trained, buffered or about to be)."""
        ...

    @property
    def rejected(self) -> int:
        """Groups rejected since the start (filtered out, failed for good, dropped as stale)."""
        ...

    def on_submit(self, count: int = 1) -> None:
        """``count`` groups were submitted (the trainer calls it for the groups a resume restored)."""

    def recover(self, version: int) -> None:
        """Restart the counts for a run resumed at ``version``: ``version`` batches accepted, nothing running."""

    def state_dict(self) -> dict[str, int]:
        """The counts, for checkpoints and the accounting record (at least running, accepted, rejected)."""
        ...


@runtime_checkable
class RolloutManager(Protocol):
    """Admits rollouts within the staleness bound, settles finished groups and fills the buffer."""

    #: The staleness bound's counts (called ``controller`` before 0.1.0: see :func:`staleness_controller_of`).
    staleness_controller: StalenessControllerLike
    #: ``time.monotonic()`` of the last group that finished (the watchdog's sign of progress).
    last_progress: float
    #: Counters since the start, logged every step (``areal/<name>``).
    failed_groups: int
    reissued_groups: int
    reissued_stale_groups: int
    dropped_stale_groups: int
    rejected_trajectories: int

    def start(self) -> None:
        """Start admitting (a thread of the manager's own); the trainer calls it once."""

    def stop(self) -> None:
        """Stop admitting and settling; nothing is admitted after it returns."""

    def pause(self) -> None:
        """Submit nothing until :meth:`resume` (weights are about to change); finished groups may be settled."""

    def resume(self, version: int) -> None:
        """Engines serve ``version`` now: submit again, within the bound at that version."""

    def suspend_polling(self) -> None:
        """Like :meth:`pause`, and do not look at TransferQueue either until :meth:`resume` (colocated engines
        sleep while the trainer computes; polling would take its devices' time)."""

    def quiesce(self) -> AbstractContextManager[None]:
        """Hold the manager between two polls for the ``with`` block: a checkpoint is taken inside it."""
        ...

    def check_alive(self) -> None:
        """Raise, in the trainer's thread, the error that stopped the manager's thread, if any."""

    def drop_stale(self, groups: list[BufferedGroup]) -> None:
        """Reject accepted groups past η (``on_stale: drop``): free their slots and TransferQueue entries."""

    def reissue_stale(self, groups: list[BufferedGroup]) -> None:
        """Generate accepted groups past η again from their prompts (``on_stale: reissue``), same slots."""


#: Members a contract renamed: contract -> {new name: old name}. An object that has only the old name still meets the
#: contract (:func:`missing_members`); the trainer reads it through :func:`staleness_controller_of`, which warns.
RENAMED_MEMBERS: dict[type, dict[str, str]] = {RolloutManager: {"staleness_controller": "controller"}}


def staleness_controller_of(manager: Any) -> StalenessControllerLike:
    """``manager.staleness_controller``; for a manager written before the rename (it has only ``controller``), that,
    with a ``DeprecationWarning`` saying what to rename. The driver reads a manager's controller only through this."""
    if hasattr(manager, "staleness_controller") or not hasattr(manager, "controller"):
        return manager.staleness_controller  # type: ignore[no-any-return]
    kind = type(manager)
    warnings.warn(
        f"{kind.__module__}.{kind.__qualname__}.controller is deprecated: name the rollout manager's staleness "
        "controller staleness_controller (areal_plugins.RolloutManager); the old name will be removed in a later "
        "release",
        DeprecationWarning,
        stacklevel=2,
    )
    return manager.controller  # type: ignore[no-any-return]


@runtime_checkable
class RewardFunction(Protocol):
    """Scores one response; called with these keywords by verl's reward loop (``rewards/hooked.py``)."""

    def __call__(self, data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None) -> float:
        """The reward (a float; the trainer records it as ``reward`` in ``BufferedGroup.info``)."""
        ...


@runtime_checkable
class PolicyLoss(Protocol):
    """The per-token objective (:func:`areal_plugins.core.losses.decoupled_ppo_loss` by default)."""

    def __call__(
        self,
        logprobs: Any,
        proximal_logprobs: Any,
        behav_logprobs: Any,
        advantages: Any,
        loss_mask: Any,
        **options: Any,
    ) -> tuple[Any, dict[str, Any]]:
        """``(token-mean loss, stats)``; ``options`` are the clip and cap settings (eps_clip, c_clip, ...)."""
        ...


@runtime_checkable
class BackendCapabilities(Protocol):
    """What a rollout backend's server class declares (:class:`areal_plugins.rollout.base.RolloutServer`)."""

    #: Names of ``areal_plugins.rollout.capabilities.CAPABILITIES`` the backend keeps.
    capabilities: frozenset[str]
    #: ``sleep`` frees the engine's memory (colocated engines must).
    releases_memory_on_sleep: bool
    #: The server runs on the GPUs Ray reserved for its replica.
    uses_reserved_gpus: bool

    @staticmethod
    def verify_weights(reply: dict[str, Any], state_dict: dict[str, Any], version: int, where: str) -> None:
        """Raise unless the server's reply to a weight update shows it loaded ``state_dict`` at ``version``."""


#: The Protocols that are called, with these arguments in this order (then keywords: the loss's options).
CALL_PARAMETERS = {
    RewardFunction: ("data_source", "solution_str", "ground_truth", "extra_info"),
    PolicyLoss: ("logprobs", "proximal_logprobs", "behav_logprobs", "advantages", "loss_mask"),
}


def contract_members(contract: type) -> list[str]:
    """The members a Protocol above declares: its annotated attributes, then its methods and properties."""
    names = list(getattr(contract, "__annotations__", {}))
    for name, value in vars(contract).items():
        public = not name.startswith("_") or name == "__len__"
        if public and name not in names and (callable(value) or isinstance(value, property)):
            names.append(name)
    return names


def missing_members(obj: object, contract: type) -> list[str]:
    """The members of ``contract`` that ``obj`` lacks, in declaration order.

    For a called contract (:data:`CALL_PARAMETERS`) the members are the parameters ``obj`` must accept.
    """
    if contract in CALL_PARAMETERS:
        return _missing_parameters(obj, CALL_PARAMETERS[contract])
    renamed = RENAMED_MEMBERS.get(contract, {})
    return [
        name
        for name in contract_members(contract)
        if name != "__call__" and not hasattr(obj, name) and not (name in renamed and hasattr(obj, renamed[name]))
    ]


def _missing_parameters(obj: object, names: tuple[str, ...]) -> list[str]:
    """The trainer calls these positionally: ``obj`` must take as many positional arguments as ``names``."""
    if not callable(obj):
        return ["__call__"]
    try:
        parameters = list(inspect.signature(obj).parameters.values())
    except (TypeError, ValueError):  # a builtin without a signature: trust it
        return []
    if any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in parameters):
        return []
    positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return [f"parameter {name!r}" for name in names[len(positional) :]]


def require_contract(obj: object, contract: type, hook: str) -> None:
    """Refuse, at startup, an object a hook returned that lacks members of ``contract``."""
    missing = missing_members(obj, contract)
    if missing:
        kind = obj if isinstance(obj, type) else type(obj)
        raise TypeError(
            f"{hook} returned a {kind.__module__}.{kind.__qualname__}, which lacks {', '.join(missing)} of the "
            f"{contract.__name__} contract (areal_plugins.hooks.contracts; docs/guides/plugins.md): add them, "
            "or let the default implementation answer (return None)"
        )


if not TYPE_CHECKING:  # type checkers see the alias below, without a __getattr__ that would make any name pass

    def __getattr__(name: str) -> Any:
        return renamed(__name__, name)  # AdmissionCounters, with a DeprecationWarning (_moved.RENAMED)

else:
    AdmissionCounters = StalenessControllerLike  # deprecated: StalenessControllerLike
