"""Which verl versions areal_plugins supports, and the check that refuses the others."""

from __future__ import annotations

from importlib import metadata

from packaging.specifiers import SpecifierSet
from packaging.version import Version

#: The verl releases our seams and patches were written and tested against.
SUPPORTED_VERL = SpecifierSet(">=0.9.1,<0.9.2")


class UnsupportedVerlVersionError(RuntimeError):
    """Raised when the installed verl is outside :data:`SUPPORTED_VERL`."""


def installed_verl_version() -> str:
    """Return the installed verl version string, or raise if verl is not installed."""
    try:
        return metadata.version("verl")
    except metadata.PackageNotFoundError as error:
        raise UnsupportedVerlVersionError(
            "verl is not installed. areal_plugins runs inside verl: `pip install 'verl==0.9.1'`."
        ) from error


def check_verl_version(version: str | None = None, supported: SpecifierSet = SUPPORTED_VERL) -> str:
    """Return the verl version if supported; raise :class:`UnsupportedVerlVersionError` otherwise."""
    found = version if version is not None else installed_verl_version()
    if Version(found) not in supported:
        raise UnsupportedVerlVersionError(
            f"areal_plugins supports verl {supported}, but verl {found} is installed. "
            f"Install a supported verl (`pip install 'verl{supported}'`) or an areal_plugins release "
            "that supports your verl."
        )
    return found
