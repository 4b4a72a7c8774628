"""The tests' fault and speed plan: every environment variable that injects a fault or slows a part down.

Production code reads none of these variables itself. It asks :func:`fault_plan` one question where the fault or the
delay belongs, and the answer is "nothing" unless a test set the variable:

* ``AREAL_CORRUPT_RECEIVED_WEIGHT=NAME`` or ``NAME@K``: from the engine's K-th weight update on (default the
  first), the first value of the received tensor NAME is + 1, as a bad transport would (both engines, on arrival).
* ``AREAL_DROP_RECEIVED_WEIGHT=NAME[,NAME...]`` or ``...@K``: the named tensors are lost on the way, as a lossy
  transport would (both engines, on arrival).
* ``AREAL_RENAME_RECEIVED_WEIGHT=NAME=OTHER[,NAME=OTHER...]`` or ``...@K``: tensor NAME arrives as OTHER, as a
  transport that mixes up names would (both engines, on arrival).
* ``AREAL_CORRUPT_LOADED_WEIGHT=NAME`` or ``NAME@K``: the first value of the engine's parameter NAME is + 1 after
  loading, as a bad load would; for a LoRA adapter NAME is the trainer's tensor name, changed in the slot the forward
  pass reads (verl's vLLM worker, rollout/verl_vllm/worker_extension.py).
* ``AREAL_TEST_ENGINE_STEP_DELAY_S``: seconds (>= 0) added to every model step of the ``areal_cpu`` engine, for the
  test suite with slow engines (rollout/cpu/server.py).
* ``AREAL_TEST_TRAINER_MICROBATCH_DELAY_S``: seconds (>= 0) added to every micro-batch of our loss, for the test suite
  with a slow trainer (trainer_workers/policy_loss.py).

An engine counts its weight updates from 1 (under LoRA the base weights and each adapter count as one each). The
variables are parsed together, once per process: a malformed value is refused wherever the plan is first asked,
naming the variable (the plan is parsed again only if one of them changes, as a test's ``monkeypatch.setenv`` does).
Fault injection travels to the run's workers in the Ray job's ``runtime_env`` (a test sets
``++ray_kwargs.ray_init.runtime_env.env_vars.NAME=...``); the speed knobs are inherited by a local run's workers
(CONTRIBUTING.md, test tiers). ``tests/unit/test_cli_cluster.py`` finds every variable a worker reads by scanning for
``os.environ`` reads: this module reads each by its constant, so the scan finds them here.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, TypeVar

if TYPE_CHECKING:
    import torch

CORRUPT_RECEIVED_ENV = "AREAL_CORRUPT_RECEIVED_WEIGHT"
DROP_RECEIVED_ENV = "AREAL_DROP_RECEIVED_WEIGHT"
RENAME_RECEIVED_ENV = "AREAL_RENAME_RECEIVED_WEIGHT"
CORRUPT_LOADED_ENV = "AREAL_CORRUPT_LOADED_WEIGHT"
ENGINE_STEP_DELAY_ENV = "AREAL_TEST_ENGINE_STEP_DELAY_S"
TRAINER_MICROBATCH_DELAY_ENV = "AREAL_TEST_TRAINER_MICROBATCH_DELAY_S"

logger = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True)
class FromUpdate(Generic[T]):
    """A fault that applies from an engine's ``first_update``-th weight update on (``...@K``; default the first)."""

    fault: T
    first_update: int = 1

    def at(self, update: int) -> T | None:
        """The fault at the engine's ``update``-th weight update (counted from 1), or None before it starts."""
        return self.fault if update >= self.first_update else None


@dataclass(frozen=True)
class FaultPlan:
    """What the tests asked to break or slow down in this process (:func:`fault_plan`); the defaults change nothing.

    Attributes:
        corrupt_received: the received tensor whose first value arrives + 1 (``AREAL_CORRUPT_RECEIVED_WEIGHT``).
        drop_received: the tensors lost on arrival (``AREAL_DROP_RECEIVED_WEIGHT``).
        rename_received: (sent name, name it arrives under) pairs (``AREAL_RENAME_RECEIVED_WEIGHT``).
        corrupt_loaded: the engine parameter whose first value is + 1 after loading (``AREAL_CORRUPT_LOADED_WEIGHT``).
        engine_step_delay_s: seconds added to each model step of ``areal_cpu`` (``AREAL_TEST_ENGINE_STEP_DELAY_S``).
        trainer_microbatch_delay_s: seconds added to each micro-batch of our loss
            (``AREAL_TEST_TRAINER_MICROBATCH_DELAY_S``).
    """

    corrupt_received: FromUpdate[str] | None = None
    drop_received: FromUpdate[frozenset[str]] | None = None
    rename_received: FromUpdate[tuple[tuple[str, str], ...]] | None = None
    corrupt_loaded: FromUpdate[str] | None = None
    engine_step_delay_s: float = 0.0
    trainer_microbatch_delay_s: float = 0.0

    @classmethod
    def parse(cls, values: Mapping[str, str]) -> FaultPlan:
        """The plan the variables in ``values`` ask for (a variable absent or empty: no fault, no delay).

        Raises:
            ValueError: a value is malformed; the message names the variable, its value and the form it takes.
        """

        def value(variable: str) -> str:
            return values.get(variable, "").strip()

        return cls(
            corrupt_received=_one_name(CORRUPT_RECEIVED_ENV, value(CORRUPT_RECEIVED_ENV)),
            drop_received=_names(DROP_RECEIVED_ENV, value(DROP_RECEIVED_ENV)),
            rename_received=_renames(RENAME_RECEIVED_ENV, value(RENAME_RECEIVED_ENV)),
            corrupt_loaded=_one_name(CORRUPT_LOADED_ENV, value(CORRUPT_LOADED_ENV)),
            engine_step_delay_s=_seconds(ENGINE_STEP_DELAY_ENV, value(ENGINE_STEP_DELAY_ENV)),
            trainer_microbatch_delay_s=_seconds(TRAINER_MICROBATCH_DELAY_ENV, value(TRAINER_MICROBATCH_DELAY_ENV)),
        )

    def received(self, weights: Iterable[tuple[str, torch.Tensor]], update: int) -> list[tuple[str, torch.Tensor]]:
        """What arrives of ``weights`` at the engine's ``update``-th weight update: the tensors to drop left out,
        the ones to rename under their new name, the one to corrupt (by its name on arrival) as a changed copy, so
        the sender's tensor and a reused transfer buffer keep what was sent. Without faults: ``weights`` as they are.
        """
        drop = (self.drop_received.at(update) if self.drop_received else None) or frozenset()
        renames = dict((self.rename_received.at(update) if self.rename_received else None) or ())
        corrupt = self.corrupt_received.at(update) if self.corrupt_received else None
        arrived = []
        for name, tensor in weights:
            if name in drop:
                logger.warning(
                    "fault injection (%s): tensor %s lost on arrival, update %d", DROP_RECEIVED_ENV, name, update
                )
                continue
            if name in renames:
                logger.warning(
                    "fault injection (%s): tensor %s arrives as %s, update %d",
                    RENAME_RECEIVED_ENV,
                    name,
                    renames[name],
                    update,
                )
                name = renames[name]
            if name == corrupt:
                tensor = tensor.detach().clone()
                tensor.view(-1)[0] += 1.0
                logger.warning(
                    "fault injection (%s): tensor %s changed on arrival, update %d", CORRUPT_RECEIVED_ENV, name, update
                )
            arrived.append((name, tensor))
        return arrived

    def loaded_target(self, update: int) -> str | None:
        """The engine parameter to change after the ``update``-th load (its first value + 1), or None."""
        return self.corrupt_loaded.at(update) if self.corrupt_loaded else None


def environment_values() -> dict[str, str]:
    """This process's values of the plan's variables ("" where unset)."""
    return {
        CORRUPT_RECEIVED_ENV: os.environ.get(CORRUPT_RECEIVED_ENV, ""),
        DROP_RECEIVED_ENV: os.environ.get(DROP_RECEIVED_ENV, ""),
        RENAME_RECEIVED_ENV: os.environ.get(RENAME_RECEIVED_ENV, ""),
        CORRUPT_LOADED_ENV: os.environ.get(CORRUPT_LOADED_ENV, ""),
        ENGINE_STEP_DELAY_ENV: os.environ.get(ENGINE_STEP_DELAY_ENV, ""),
        TRAINER_MICROBATCH_DELAY_ENV: os.environ.get(TRAINER_MICROBATCH_DELAY_ENV, ""),
    }


_parsed: tuple[dict[str, str], FaultPlan] | None = None


def fault_plan() -> FaultPlan:
    """This process's plan, parsed from its environment once (again only if one of the variables changed).

    Raises:
        ValueError: a variable's value is malformed (the message names it).
    """
    global _parsed
    values = environment_values()
    if _parsed is None or _parsed[0] != values:
        _parsed = (values, FaultPlan.parse(values))
    return _parsed[1]


def _refuse(variable: str, raw: str, why: str, form: str) -> ValueError:
    return ValueError(f"{variable}={raw!r}: {why}; set it to {form}, or unset it")


def _from_update(variable: str, raw: str, form: str) -> tuple[str, int]:
    """``raw`` split into its fault and the first update (``...@K``, K >= 1; without ``@K``: 1)."""
    fault, at, first = raw.partition("@")
    if not at:
        return fault.strip(), 1
    try:
        update = int(first)
    except ValueError:
        update = 0
    if update < 1:
        raise _refuse(variable, raw, f"{first!r} after '@' is not a weight update (1, 2, ...)", form)
    return fault.strip(), update


def _one_name(variable: str, raw: str) -> FromUpdate[str] | None:
    if not raw:
        return None
    form = "NAME or NAME@K (a tensor name, from the K-th weight update on)"
    name, first = _from_update(variable, raw, form)
    if not name or "," in name:
        raise _refuse(variable, raw, "it names no tensor, or more than one", form)
    return FromUpdate(name, first)


def _names(variable: str, raw: str) -> FromUpdate[frozenset[str]] | None:
    if not raw:
        return None
    form = "NAME[,NAME...] or NAME[,NAME...]@K (tensor names, from the K-th weight update on)"
    names, first = _from_update(variable, raw, form)
    listed = [name.strip() for name in names.split(",")]
    if not all(listed):
        raise _refuse(variable, raw, "an empty tensor name", form)
    return FromUpdate(frozenset(listed), first)


def _renames(variable: str, raw: str) -> FromUpdate[tuple[tuple[str, str], ...]] | None:
    if not raw:
        return None
    form = "NAME=OTHER[,NAME=OTHER...] or ...@K (tensor NAME arrives as OTHER from the K-th weight update on)"
    pairs, first = _from_update(variable, raw, form)
    renames = []
    for pair in pairs.split(","):
        sent, equals, arrives = (part.strip() for part in pair.partition("="))
        if not (sent and equals and arrives):
            raise _refuse(variable, raw, f"{pair.strip()!r} is not NAME=OTHER", form)
        renames.append((sent, arrives))
    return FromUpdate(tuple(renames), first)


def _seconds(variable: str, raw: str) -> float:
    """``raw`` as seconds (empty: 0); a value that is not a finite number >= 0 is refused, naming ``variable``."""
    try:
        seconds = float(raw) if raw else 0.0
    except ValueError:
        seconds = -1.0
    if not 0.0 <= seconds < math.inf:  # NaN too
        raise _refuse(variable, raw, "not a number of seconds >= 0", "a number of seconds >= 0")
    return seconds
