"""The plugin API holds still: every name the docs show a plugin importing imports from where they show it, all from
the public modules, and a name that moved keeps its old import path with a ``DeprecationWarning`` naming the new place
(a plugin package written from earlier docs still loads)."""

from __future__ import annotations

import ast
import importlib
import logging
import re
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest

import areal_plugins
import areal_plugins.testing
from areal_plugins._moved import MOVED
from areal_plugins.plugin_manager import build_plugin_manager

REPO = Path(__file__).resolve().parents[2]
#: The plugin API (``areal_plugins.__all__``) and its test kit: the only modules the docs may show a plugin importing.
PUBLIC = {"areal_plugins": areal_plugins.__all__, "areal_plugins.testing": areal_plugins.testing.__all__}
#: What the plugin guide showed at an old path before a move, and the same object's name in the plugin API.
OLD_DOCS_IMPORTS = [
    ("areal_plugins.trainers.admission", "AdmissionLoop"),
    ("areal_plugins.trainers.settled_groups", "start_inbox"),
    ("areal_plugins.trainers.settled_groups", "drain_reports"),
    ("areal_plugins.hooks.manager", "call_hook"),
    ("areal_plugins.hooks.manager", "build_plugin_manager"),
]
IMPORT_LINE = re.compile(r"^\s*(from\s+areal_plugins[\w.]*\s+import\s+[^#\n]+|import\s+areal_plugins[\w.]*)", re.M)


def imports_in(code: str) -> list[tuple[str, str]]:
    """``(module, name)`` for each ``areal_plugins`` import in ``code`` (``name`` empty for ``import module``); a
    sketch that does not parse as a whole is read line by line."""
    try:
        trees = [ast.parse(textwrap.dedent(code))]
    except SyntaxError:
        trees = [ast.parse(line.strip()) for line in IMPORT_LINE.findall(code)]
    found = []
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "areal_plugins":
                found += [(node.module, alias.name) for alias in node.names]
            elif isinstance(node, ast.Import):
                found += [(alias.name, "") for alias in node.names if alias.name.split(".")[0] == "areal_plugins"]
    return found


def documented_imports() -> list[tuple[str, str, str]]:
    """``(docs file, module, name)`` for every import of ``areal_plugins`` the docs show: in a Python code block or in
    an inline code span."""
    found = []
    for path in sorted((REPO / "docs").rglob("*.md")):
        text = path.read_text()
        snippets = re.findall(r"```python\n(.*?)```", text, flags=re.S)
        snippets += re.findall(r"`((?:from|import) areal_plugins[^`\n]*)`", text)
        found += [(str(path.relative_to(REPO)), *imported) for code in snippets for imported in imports_in(code)]
    return found


def test_the_docs_show_imports_of_the_plugin_api():
    names = {(module, name) for _, module, name in documented_imports()}
    assert {("areal_plugins", "hookimpl"), ("areal_plugins", "Hooks"), ("areal_plugins", "AdmissionLoop")} <= names
    assert ("areal_plugins.testing", "check_sample_buffer") in names


def test_every_name_the_docs_show_imports_from_where_they_show_it():
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*areal_plugins", category=DeprecationWarning)  # never an old path
        for doc, module, name in documented_imports():
            imported = importlib.import_module(module)
            assert not name or getattr(imported, name, None) is not None, f"{doc}: from {module} import {name}"


def test_the_docs_import_only_from_the_plugin_api():
    for doc, module, name in documented_imports():
        assert module in PUBLIC, f"{doc} imports from {module}: show the name's import from areal_plugins"
        assert name in PUBLIC[module], f"{doc}: {name} is not in {module}.__all__"


def test_the_function_that_reads_imports_finds_them_in_a_sketch():
    sketch = "from areal_plugins import A, B\nimport areal_plugins.testing\nmanager = ...(\n"  # does not parse
    assert imports_in(sketch) == [("areal_plugins", "A"), ("areal_plugins", "B"), ("areal_plugins.testing", "")]


@pytest.mark.parametrize("old, name", OLD_DOCS_IMPORTS)
def test_a_name_that_moved_still_imports_from_its_old_path_with_a_warning(old, name):
    namespace: dict = {}
    advice = f"import {name} from areal_plugins"
    with pytest.warns(DeprecationWarning, match=rf"^{re.escape(old)} is deprecated: {advice}\b") as caught:
        exec(compile(f"from {old} import {name}", __file__, "exec"), namespace)  # as a plugin's module would
    assert namespace[name] is getattr(areal_plugins, name)
    assert {Path(w.filename).name for w in caught} == {Path(__file__).name}, "the warning points at the import line"


def test_every_moved_module_names_an_existing_place():
    for old, new in MOVED.items():
        importlib.import_module(new)
        module = importlib.import_module(old)
        with pytest.raises(AttributeError, match=rf"{re.escape(old)!s}.*moved to {re.escape(new)}"):
            module.no_such_name  # noqa: B018


@pytest.fixture
def plugin_from_the_old_docs(tmp_path):
    """A plugin package written from the plugin guide before the folders moved (its manager imported ``AdmissionLoop``
    from ``areal_plugins.trainers.admission``), installed through the entry-point group, removed after the test."""
    (tmp_path / "areal_heldout_steady_manager.py").write_text(
        textwrap.dedent(
            """
            from areal_plugins import hookimpl
            from areal_plugins.trainers.admission import AdmissionLoop

            AREAL_PLUGIN_OPT_IN = True


            @hookimpl
            def areal_make_rollout_manager(config, buffer, submit_prompts, accept_trajectory, reissue_prompts):
                return None  # a manager built on AdmissionLoop would be returned here


            @hookimpl
            def areal_make_policy_loss(config):
                return None
            """
        )
    )
    dist = tmp_path / "areal_heldout_steady_manager-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: areal-heldout-steady-manager\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[areal_plugins]\nheldout_steady_manager = areal_heldout_steady_manager\n")
    sys.path.insert(0, str(tmp_path))
    importlib.invalidate_caches()
    try:
        yield "heldout_steady_manager"
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("areal_heldout_steady_manager", None)
        importlib.invalidate_caches()


def test_a_plugin_written_from_the_old_docs_still_loads_and_the_log_says_what_to_change(
    plugin_from_the_old_docs, caplog
):
    with caplog.at_level(logging.WARNING, logger="areal_plugins.plugin_manager"):
        with pytest.warns(DeprecationWarning) as caught:
            manager = build_plugin_manager(include=[plugin_from_the_old_docs])
    assert manager.get_plugin(plugin_from_the_old_docs) is not None
    messages = [str(w.message) for w in caught]
    assert any("import AdmissionLoop from areal_plugins" in m for m in messages), messages
    assert any("the config argument is deprecated" in m for m in messages), messages
    logged = [r.getMessage() for r in caplog.records]
    assert any(
        f"plugin {plugin_from_the_old_docs!r}" in m and "areal_plugins.trainers.admission is deprecated" in m
        for m in logged
    ), logged
    assert any(f"plugin {plugin_from_the_old_docs!r}" in m and "config argument is deprecated" in m for m in logged)


def test_importing_the_plugin_api_imports_neither_verl_nor_ray_nor_torch():
    code = "import sys, areal_plugins; print(sorted({m.split('.')[0] for m in sys.modules} & {'verl', 'ray', 'torch'}))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert result.stdout.strip() == "[]"
