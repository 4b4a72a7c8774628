"""The CPU demo's tiny model, tokenizer and tasks (``areal-plugins train`` builds them for the CPU recipes).

What only they need is the ``cpu-demo`` extra (``pip install 'areal-plugins[cpu-demo]'``; ``tools/setup.sh``
installs it): a GPU install goes without, and :func:`cpu_demo_module` says so where one is missing.
"""

from __future__ import annotations

import importlib
from types import ModuleType

#: The install line of what only the CPU demo needs (pyproject.toml's ``cpu-demo`` extra).
CPU_DEMO_INSTALL = "pip install 'areal-plugins[cpu-demo]'"


def cpu_demo_module(name: str, needed_for: str) -> ModuleType:
    """Import ``name``, a dependency of the ``cpu-demo`` extra only.

    Raises:
        ModuleNotFoundError: ``name`` is not installed; the message names what needs it and the install line.
    """
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as error:
        if error.name != name:  # the module is there and something it imports is not: not ours to explain
            raise
        raise ModuleNotFoundError(
            f"{needed_for} needs {name}, which only the CPU demo installs: {CPU_DEMO_INSTALL} (tools/setup.sh does)",
            name=name,
        ) from error
