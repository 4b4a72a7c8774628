"""Each patch says which upstream issue or PR to watch, and takes the supported verl range from one place.

A patch is deleted when upstream gives the seam it stands in for; "Remove when" names what to watch so that the next
verl release is a list to check, not a hunt (issue 62, item 9). The verl range every patch refuses outside of is
:data:`areal_plugins._compat.SUPPORTED_VERL`, imported, never written out again in a patch.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PATCH_FILES = sorted(path for path in (ROOT / "patches").glob("*.py") if not path.name.startswith("_"))
#: An issue or PR by number (``verl issue #5392``, ``vLLM issue #42821``), or the explicit fallback with the file.
WATCHED = re.compile(r"#\d+|no\s+upstream\s+issue\s+yet:\s+watch\s+``[\w/.]+``")


def remove_when(source: str) -> str:
    """The module docstring's *Remove when* paragraph (up to the next blank line)."""
    doc = ast.get_docstring(ast.parse(source)) or ""
    _, found, rest = doc.partition("*Remove when*")
    return rest.split("\n\n", 1)[0] if found else ""


def verl_ranges_written_out(source: str) -> list[int]:
    """Lines assigning ``SUPPORTED_VERL`` in the module itself (instead of importing the shared one)."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(target, ast.Name) and target.id == "SUPPORTED_VERL" for target in targets):
                lines.append(node.lineno)
    return lines


@pytest.mark.parametrize("path", PATCH_FILES, ids=lambda path: path.name)
def test_remove_when_names_what_to_watch(path: Path) -> None:
    paragraph = remove_when(path.read_text())
    assert paragraph, f"{path.name}: the docstring has no *Remove when* paragraph"
    assert WATCHED.search(paragraph), (
        f"{path.name}: *Remove when* names no upstream issue or PR to watch (#<number>), nor says "
        f"'no upstream issue yet: watch ``<file>``': {paragraph!r}"
    )


@pytest.mark.parametrize("path", PATCH_FILES, ids=lambda path: path.name)
def test_the_verl_range_is_imported_from_compat(path: Path) -> None:
    written = verl_ranges_written_out(path.read_text())
    assert not written, (
        f"{path.name}:{written}: SUPPORTED_VERL written out again; import it (from areal_plugins._compat import "
        "SUPPORTED_VERL) so that one constant says which verl the patches support"
    )


def test_every_patch_refuses_by_the_one_range() -> None:
    from areal_plugins import _compat, patches

    for _, _, patch in patches.PATCHES:
        supported = getattr(patch, "SUPPORTED_VERL", None)
        if supported is not None:
            assert supported is _compat.SUPPORTED_VERL, patch.__name__


def test_the_checks_see_a_missing_watch_and_a_repeated_range() -> None:
    bare = '"""Patch.\n\n*Why*: x. *Upstream*: none. *Remove when*: verl has a seam.\n"""\n'
    assert not WATCHED.search(remove_when(bare))
    assert WATCHED.search(remove_when(bare.replace("has a seam.", "has a seam; watch verl issue #5392.")))
    assert verl_ranges_written_out('SUPPORTED_VERL = SpecifierSet(">=0.9.1,<0.9.2")\n') == [1]
    assert verl_ranges_written_out("from areal_plugins._compat import SUPPORTED_VERL\n") == []
