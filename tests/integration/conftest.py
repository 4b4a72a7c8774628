from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TINY_DIR = REPO / ".areal" / "tiny"  # shared with the demo: built once per machine
#: A folder holding an example plugin and its .dist-info: on PYTHONPATH, it is an installed plugin.
EXAMPLE_PLUGIN_DIR = REPO / "tests" / "example_plugin"


def with_example_plugin(**extra: str) -> dict[str, str]:
    """Environment in which the example plugin is installed (for the run and its Ray workers)."""
    env = dict(os.environ, **extra)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(EXAMPLE_PLUGIN_DIR), env.get("PYTHONPATH")) if p)
    return env


def run_cli(*args: str, timeout: int = 900, env: dict[str, str] | None = None, check: bool = True):
    """Run ``areal-plugins`` as a user would; fail with its output on a non-zero exit if ``check``."""
    result = subprocess.run(
        [sys.executable, "-m", "areal_plugins.cli", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )
    if check and result.returncode != 0:
        pytest.fail(f"areal-plugins {' '.join(args)} exited {result.returncode}:\n{result.stderr[-4000:]}")
    return result


@pytest.fixture(scope="session")
def tiny_dir() -> Path:
    run_cli("build-tiny", "--out", str(TINY_DIR))
    return TINY_DIR


def train_args(recipe: str, run_dir: Path, tiny_dir: Path, steps: int, *overrides: str) -> list[str]:
    """``areal-plugins train`` arguments for ``steps`` steps of ``recipe`` without validation."""
    return [
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
    ]


def train_tiny(
    recipe: str, run_dir: Path, tiny_dir: Path, steps: int, *overrides: str, env: dict[str, str] | None = None
) -> list[dict]:
    """Train ``recipe`` for ``steps`` steps without validation; return the per-step metrics."""
    import json

    run_cli(*train_args(recipe, run_dir, tiny_dir, steps, *overrides), env=env)
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["data"] for line in lines if line.strip()]
