"""The plugin guide's template works as printed: its plugin module and its tests, copied out of
``docs/guides/plugins.md`` into a fresh folder, pass under pytest (a template that drifted from the hooks fails)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "guides" / "plugins.md"


def guide_files() -> dict[str, str]:
    """``path -> code`` for every Python block of the guide whose first line is ``# <path>``."""
    files = {}
    for block in re.findall(r"```python\n(.*?)```", GUIDE.read_text(), flags=re.S):
        first = block.splitlines()[0]
        if first.startswith("# ") and first.endswith(".py"):
            files[first[2:].strip()] = block
    return files


def test_the_guide_names_a_plugin_its_conftest_and_its_tests():
    assert {"my_package/plugin.py", "tests/conftest.py", "tests/test_plugin.py"} <= set(guide_files())


def test_the_guides_plugin_passes_the_guides_tests(tmp_path):
    for relative, code in guide_files().items():
        path = tmp_path / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(code)
    (tmp_path / "my_package" / "__init__.py").touch()
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_plugin.py"]
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert re.search(r"\b2 passed\b", result.stdout), result.stdout[-1000:]
