"""Shared machinery of our version-guarded patches: replace module attributes, keep the originals."""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from packaging.specifiers import SpecifierSet

from areal_plugins._compat import check_verl_version

logger = logging.getLogger(__name__)


@dataclass
class AttributePatch:
    """Replace ``module.attr`` for each target with ``make_replacement(original)``.

    ``apply()`` refuses unsupported verl versions, is idempotent and logs once; ``revert()`` puts
    back the very same original objects.
    """

    name: str
    targets: tuple[tuple[str, str], ...]
    make_replacement: Callable[[Any], Any]
    supported_verl: SpecifierSet
    _originals: dict[tuple[str, str], Any] = field(default_factory=dict)

    def is_applied(self) -> bool:
        return bool(self._originals)

    def apply(self, verl_version: str | None = None) -> None:
        if self.is_applied():
            return
        check_verl_version(verl_version, self.supported_verl)
        # All or nothing: resolve every target and build every replacement before touching any.
        originals: dict[tuple[str, str], Any] = {}
        replacements = []
        for module_name, attr in self.targets:
            module = importlib.import_module(module_name)
            original = getattr(module, attr)
            originals[(module_name, attr)] = original
            replacements.append((module, attr, self.make_replacement(original)))
        for module, attr, replacement in replacements:
            setattr(module, attr, replacement)
        self._originals = originals
        logger.info("areal_plugins: applied patch %s", self.name)

    def revert(self) -> None:
        for (module_name, attr), original in self._originals.items():
            setattr(importlib.import_module(module_name), attr, original)
        self._originals.clear()

    def original(self, module_name: str, attr: str) -> Any:
        return self._originals[(module_name, attr)]
