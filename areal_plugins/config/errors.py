"""The error of a recipe refused before anything starts (``areal-plugins check``, ``train``)."""

from __future__ import annotations


class RecipeRefusedError(Exception):
    """A recipe that cannot run; ``str()`` is the one line to show, naming what to change."""
