"""The benchmarks' stand-ins, for ``tools/`` and the tests only (not in the wheel): the paced engine with no model
(rollout backend ``areal_paced``), the GPU cases it stands in for, the synchronous baseline's sampler, and the AReaL
paper's setup the cluster simulator is fitted to.

A verl run that uses them needs this package in every one of its processes, and ``areal_paced`` registered in each
(:mod:`areal_bench.verl_backend`). The bench gets it there itself:

- Ray workers, on any node: Ray's ``runtime_env`` ``py_modules`` ships this folder to every worker of the job
  (:func:`runtime_env`, :func:`run_overrides`); a worker is not started from this checkout, so nothing else would
  put ``tools/`` on its path.
- Registration: verl imports the modules ``VERL_USE_EXTERNAL_MODULES`` names at ``import verl``, in every process,
  before its plugins; :mod:`areal_bench.verl_backend` then adds ``areal_paced`` to our backends
  (:func:`areal_plugins.rollout.verl_registration.register_backend`) before verl's registries are read. The variable
  travels in the job's ``runtime_env`` (:func:`run_overrides`).
- The two processes started before Ray (the CLI's recipe check and verl's driver, ``main_ppo``) import verl too:
  :func:`run_environment` puts ``tools/`` on their ``PYTHONPATH`` and sets the variable there.

verl's other seam, an entry point in the ``verl.plugins`` group, needs an installed distribution: the very thing the
wheel must not carry.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

#: This package's folder (``tools/areal_bench``): what Ray ships to the workers.
PACKAGE = Path(__file__).resolve().parent
#: verl imports each module this variable names (comma-separated) at ``import verl``, in every process.
EXTERNAL_MODULES = "VERL_USE_EXTERNAL_MODULES"
#: The module that registers ``areal_paced`` where it is imported.
REGISTRATION = f"{__name__}.verl_backend"
#: The module that records which version generated each trained token, in the bench's verl rows only
#: (:mod:`areal_bench.verl_token_versions`; our rows record their own).
TOKEN_VERSIONS = f"{__name__}.verl_token_versions"


def runtime_env() -> dict[str, Any]:
    """Ray's ``runtime_env`` that ships this package to every worker of a job (``ray.init(runtime_env=...)``)."""
    return {"py_modules": [str(PACKAGE)]}


def external_modules(env: Mapping[str, str], token_versions: bool = False) -> str:
    """``VERL_USE_EXTERNAL_MODULES``: what ``env`` names already, and :data:`REGISTRATION` (and with
    ``token_versions``, :data:`TOKEN_VERSIONS`)."""
    named = [name for name in env.get(EXTERNAL_MODULES, "").split(",") if name]
    for module in (REGISTRATION, *([TOKEN_VERSIONS] if token_versions else [])):
        named = named if module in named else [*named, module]
    return ",".join(named)


def run_environment(env: Mapping[str, str], token_versions: bool = False) -> dict[str, str]:
    """``env`` for the first processes of a verl run (the CLI, verl's driver): ``tools/`` on ``PYTHONPATH``, and verl
    told to import :data:`REGISTRATION` (and :data:`TOKEN_VERSIONS` with ``token_versions``: a verl row)."""
    paths = [path for path in env.get("PYTHONPATH", "").split(os.pathsep) if path]
    tools = str(PACKAGE.parent)
    return {
        **env,
        "PYTHONPATH": os.pathsep.join(paths if tools in paths else [tools, *paths]),
        EXTERNAL_MODULES: external_modules(env, token_versions),
    }


def run_overrides(env: Mapping[str, str], token_versions: bool = False) -> list[str]:
    """Hydra overrides that give the run's Ray job this package (``py_modules``) and verl's variable (``env_vars``),
    so that every worker, on any node, registers ``areal_paced`` (and with ``token_versions`` records the versions of
    a verl row's trained tokens)."""
    modules = external_modules(env, token_versions)
    for text in (str(PACKAGE), modules):
        if "'" in text:
            raise SystemExit(f"{text!r}: a quote cannot be passed to the Ray job; rename it")
    return [
        f"++ray_kwargs.ray_init.runtime_env.py_modules=['{PACKAGE}']",
        f"++ray_kwargs.ray_init.runtime_env.env_vars.{EXTERNAL_MODULES}='{modules}'",
    ]
