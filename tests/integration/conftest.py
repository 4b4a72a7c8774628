from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TINY_DIR = REPO / ".areal" / "tiny"  # shared with the demo: built once per machine


def run_cli(*args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    """Run ``areal-plugins`` as a user would; fail with its output on a non-zero exit."""
    result = subprocess.run(
        [sys.executable, "-m", "areal_plugins.cli", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if result.returncode != 0:
        pytest.fail(f"areal-plugins {' '.join(args)} exited {result.returncode}:\n{result.stdout[-4000:]}")
    return result


@pytest.fixture(scope="session")
def tiny_dir() -> Path:
    run_cli("build-tiny", "--out", str(TINY_DIR))
    return TINY_DIR
