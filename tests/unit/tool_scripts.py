"""Import a script of ``tools/`` (not a package) as a module, for unit tests of its arithmetic."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

TOOLS = Path(__file__).resolve().parents[2] / "tools"


def load_tool(name: str) -> ModuleType:
    if str(TOOLS) not in sys.path:  # as when a tool runs as a script: its helpers (repeats.py) import by name
        sys.path.append(str(TOOLS))
    spec = importlib.util.spec_from_file_location(name, TOOLS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module
