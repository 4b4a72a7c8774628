"""A hook called through the typed facade (``plugin_manager.Hooks``) is checked by mypy: a misspelled hook, a
misspelled argument or an argument of the wrong type fails type-checking, and the correct call passes (tox 4's
facade; issue 62, item 6). mypy runs on one snippet file with ``--follow-imports=silent``, in about a second."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("mypy")  # a dev dependency (pyproject.toml, [dev])

REPO = Path(__file__).resolve().parents[2]


def mypy(tmp_path: Path, code: str) -> subprocess.CompletedProcess:
    """mypy with the repository's settings on ``code`` alone (imported modules read, their errors not reported)."""
    snippet = tmp_path / "snippet.py"
    snippet.write_text(textwrap.dedent(code))
    command = [sys.executable, "-m", "mypy", "--config-file", str(REPO / "pyproject.toml"), "--follow-imports=silent"]
    command += ["--cache-dir", str(tmp_path / "mypy_cache"), "--no-color-output", str(snippet)]
    return subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120)


def test_a_correctly_spelled_hook_call_passes_mypy(tmp_path):
    checked = mypy(
        tmp_path,
        """
        from areal_plugins import Hooks

        hooks = Hooks()
        hooks.before_weight_update(version=1)
        hooks.after_train_step(step=1, metrics={"loss": 0.5})
        """,
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_a_misspelled_hook_or_argument_fails_mypy_naming_it(tmp_path):
    checked = mypy(
        tmp_path,
        """
        from areal_plugins import Hooks

        hooks = Hooks()
        hooks.before_weight_updat(version=1)
        hooks.before_weight_update(versoin=1)
        hooks.before_weight_update(version="1")
        """,
    )
    assert checked.returncode == 1, checked.stdout + checked.stderr
    errors = [line for line in checked.stdout.splitlines() if ": error: " in line]
    assert len(errors) == 3, checked.stdout
    assert ":5: error:" in errors[0] and '"Hooks" has no attribute "before_weight_updat"' in errors[0]
    assert errors[0].endswith("[attr-defined]")
    assert ":6: error:" in errors[1] and '"versoin"' in errors[1] and errors[1].endswith("[call-arg]")
    assert ":7: error:" in errors[2] and errors[2].endswith("[arg-type]")
