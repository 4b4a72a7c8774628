"""The error every check of the conformance kit raises."""

from __future__ import annotations


class ContractViolationError(AssertionError):
    """An implementation breaks a contract of :mod:`areal_plugins.hooks.contracts`; the message says which rule."""


def rule(contract: str, holds: bool, broken: str) -> None:
    """Raise :class:`ContractViolationError` naming ``contract`` and the rule ``broken`` unless ``holds``."""
    if not holds:
        raise ContractViolationError(f"{contract} contract: {broken}")
