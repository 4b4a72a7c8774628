"""The documentation site: generated reference pages are current, the strict build catches a broken link or a
page left out (the site itself is built by tools/test.sh), and the README stays a five-minute read that links
into the site."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.unit.tool_scripts import load_tool

REPO = Path(__file__).resolve().parents[2]
MKDOCS = Path(sys.executable).with_name("mkdocs")


def test_the_settings_page_is_generated_from_the_dataclasses():
    tool = load_tool("gen_reference_docs")
    assert tool.SETTINGS_PAGE.read_text() == tool.render_settings(), "run: python tools/gen_reference_docs.py"


def test_the_cli_page_is_generated_from_the_parsers():
    tool = load_tool("gen_reference_docs")
    assert tool.CLI_PAGE.read_text() == tool.render_cli(), "run: python tools/gen_reference_docs.py"


def test_the_settings_page_lists_every_key_once():
    """An independent count: every dotted key of the shipped default.yaml's areal node appears in one row."""
    import yaml

    node = yaml.safe_load((REPO / "areal_plugins" / "config" / "areal" / "default.yaml").read_text())["areal"]

    def leaves(mapping: dict, path: str) -> list[str]:
        out = []
        for key, value in mapping.items():
            out += leaves(value, f"{path}.{key}") if isinstance(value, dict) else [f"{path}.{key}"]
        return out

    page = (REPO / "docs" / "reference" / "settings.md").read_text()
    rows = re.findall(r"^\| `(areal\.[\w.]+)` \|", page, flags=re.M)
    assert sorted(rows) == sorted(leaves(node, "areal"))


def _build(site_src: Path, tmp_path: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(MKDOCS), "build", "--strict", "-f", str(site_src / "mkdocs.yml"), "-d", str(tmp_path / "site")],
        capture_output=True,
        text=True,
        env={"NO_MKDOCS_2_WARNING": "1", "PATH": "/usr/bin:/bin"},
    )


@pytest.fixture()
def site_copy(tmp_path):
    copy = tmp_path / "src"
    copy.mkdir()
    shutil.copy(REPO / "mkdocs.yml", copy / "mkdocs.yml")
    shutil.copytree(REPO / "docs", copy / "docs")
    return copy


def test_a_broken_link_fails_the_build(site_copy, tmp_path):
    page = site_copy / "docs" / "guides" / "quickstart.md"
    page.write_text(page.read_text() + "\nSee [the missing page](no_such_page.md).\n")
    result = _build(site_copy, tmp_path)
    assert result.returncode != 0
    assert "no_such_page.md" in result.stderr


def test_a_page_left_out_of_the_nav_fails_the_build(site_copy, tmp_path):
    (site_copy / "docs" / "orphan.md").write_text("# Orphan\n")
    result = _build(site_copy, tmp_path)
    assert result.returncode != 0
    assert "orphan.md" in result.stderr


def test_the_readme_is_short_and_its_links_resolve():
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    targets = re.findall(r"\]\(((?!https?://)[^)#]+)", readme)
    assert targets, "the README links into the docs"
    missing = [t for t in targets if not (REPO / t).exists()]
    assert not missing, f"README links to missing files: {missing}"


def test_the_readme_keeps_the_two_commands():
    readme = (REPO / "README.md").read_text()
    first_screen = "\n".join(readme.splitlines()[:40])
    assert "bash tools/setup.sh && .venv/bin/areal-plugins train recipes/grpo_cpu_async.yaml" in first_screen
    assert "bash tools/test.sh" in first_screen
