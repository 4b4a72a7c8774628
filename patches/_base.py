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

    ``attr`` may be dotted (``Class.method``): the last name is replaced on the object the others lead to.

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
            owner, name = _owner(module_name, attr)
            original = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
            originals[(module_name, attr)] = original
            replacements.append((owner, name, self.make_replacement(original)))
        for owner, name, replacement in replacements:
            setattr(owner, name, replacement)
        self._originals = originals
        logger.info("areal_plugins: applied patch %s", self.name)

    def revert(self) -> None:
        for (module_name, attr), original in self._originals.items():
            setattr(*_owner(module_name, attr), original)
        self._originals.clear()

    def original(self, module_name: str, attr: str) -> Any:
        return self._originals[(module_name, attr)]


def _owner(module_name: str, attr: str) -> tuple[Any, str]:
    """The object that holds ``attr``'s last name (the module, or the class a dotted ``attr`` names) and that name."""
    owner: Any = importlib.import_module(module_name)
    *path, name = attr.split(".")
    for part in path:
        owner = getattr(owner, part)
    return owner, name
