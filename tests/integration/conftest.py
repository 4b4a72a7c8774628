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


def train_tiny(recipe: str, run_dir: Path, tiny_dir: Path, steps: int, *overrides: str) -> list[dict]:
    """Train ``recipe`` for ``steps`` steps without validation; return the per-step metrics."""
    import json

    run_cli(
        "train",
        str(REPO / "recipes" / recipe),
        f"trainer.total_training_steps={steps}",
        "trainer.val_before_train=false",
        "trainer.test_freq=-1",
        *overrides,
        "--run-dir",
        str(run_dir),
        "--tiny-dir",
        str(tiny_dir),
    )
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["data"] for line in lines if line.strip()]
