"""Registers the paced engine as rollout backend ``areal_paced`` in the process that imports this module.

verl imports it in every process of a bench run (``VERL_USE_EXTERNAL_MODULES``, :mod:`areal_bench`); a test or a tool
that builds the backend in its own process imports it, or calls :func:`register`.
"""

from __future__ import annotations

from areal_plugins.rollout.verl_registration import register_backend

#: ``actor_rollout_ref.rollout.name`` of the paced engine.
BACKEND = "areal_paced"
SERVER = "areal_bench.paced_engine:VerlPacedServer"


def register() -> None:
    """Add ``areal_paced`` to our rollout backends in this process (idempotent)."""
    register_backend(BACKEND, SERVER)


register()
