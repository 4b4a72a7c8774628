"""Shared machinery of our version-guarded patches: replace module attributes, keep the originals."""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from areal_plugins.patches._after_import import installed, is_imported
from packaging.specifiers import SpecifierSet

from areal_plugins._compat import check_verl_version

logger = logging.getLogger(__name__)


@dataclass
class AttributePatch:
    """Replace ``module.attr`` for each target with ``make_replacement(original)``.

    ``attr`` may be dotted (``Class.method``): the last name is replaced on the object the others lead to.

    ``apply()`` refuses unsupported verl versions, is idempotent and logs once; ``revert()`` puts
    back the very same original objects.

    A target whose module is in ``on_import`` and not imported yet is not imported by ``apply()``: it is patched the
    moment something else imports its module (:mod:`areal_plugins.patches._after_import`), before anyone can use it.
    Where that module imported a patched function by name from another target's module, it holds the replacement
    already; it keeps it, and ``revert()`` gives it the original back.
    """

    name: str
    targets: tuple[tuple[str, str], ...]
    make_replacement: Callable[[Any], Any]
    supported_verl: SpecifierSet
    on_import: frozenset[str] = frozenset()
    _originals: dict[tuple[str, str], Any] = field(default_factory=dict)
    _replacements: dict[tuple[str, str], Any] = field(default_factory=dict)
    _applied: bool = False

    def is_applied(self) -> bool:
        return self._applied

    def apply(self, verl_version: str | None = None) -> None:
        if self.is_applied():
            return
        check_verl_version(verl_version, self.supported_verl)
        later = {module for module in self.on_import if not is_imported(module)}
        self._patch([target for target in self.targets if target[0] not in later])
        self._applied = True
        for module in sorted(later):
            installed().watch(module, _PatchOnImport(self, module))
        logger.info("areal_plugins: applied patch %s", self.name)

    def revert(self) -> None:
        for (module_name, attr), original in self._originals.items():
            setattr(*_owner(module_name, attr), original)
        self._originals.clear()
        self._replacements.clear()
        self._applied = False  # a module imported from now on stays unpatched (_PatchOnImport finds it reverted)

    def original(self, module_name: str, attr: str) -> Any:
        return self._originals[(module_name, attr)]

    def patch_imported(self, module_name: str) -> None:
        """Patch ``module_name``'s targets, now imported, if the patch is applied and they are not patched yet."""
        if self._applied:
            self._patch([t for t in self.targets if t[0] == module_name and t not in self._originals])

    def _patch(self, targets: list[tuple[str, str]]) -> None:
        # All or nothing: resolve every target and build every replacement before touching any.
        originals: dict[tuple[str, str], Any] = {}
        replacements = []
        for module_name, attr in targets:
            owner, name = _owner(module_name, attr)
            current = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
            bound = next((key for key, replacement in self._replacements.items() if replacement is current), None)
            if bound is not None:  # imported by name from a patched module: holds our replacement already
                originals[(module_name, attr)] = self._originals[bound]
                replacements.append((owner, name, current))
            else:
                originals[(module_name, attr)] = current
                replacements.append((owner, name, self.make_replacement(current)))
        for (owner, name, replacement), key in zip(replacements, originals, strict=True):
            setattr(owner, name, replacement)
            self._replacements[key] = replacement
        self._originals.update(originals)


class _PatchOnImport:
    """What :meth:`AttributePatch.apply` leaves waiting for a module it did not import (equal for the same ones)."""

    def __init__(self, patch: AttributePatch, module_name: str) -> None:
        self.patch = patch
        self.module_name = module_name

    def __call__(self) -> None:
        self.patch.patch_imported(self.module_name)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _PatchOnImport) and other.patch is self.patch and other.module_name == self.module_name

    def __hash__(self) -> int:
        return hash((id(self.patch), self.module_name))

    def __repr__(self) -> str:
        return f"patch {self.patch.name} in {self.module_name}"


def _owner(module_name: str, attr: str) -> tuple[Any, str]:
    """The object that holds ``attr``'s last name (the module, or the class a dotted ``attr`` names) and that name."""
    owner: Any = importlib.import_module(module_name)
    *path, name = attr.split(".")
    for part in path:
        owner = getattr(owner, part)
    return owner, name
