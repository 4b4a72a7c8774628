"""The vLLM environment's own launchers: the docs and the CPU refusal tell users to run
``.venv-verl-vllm/bin/areal-plugins``, a hard-linked copy of ``.venv``'s (tools/setup.sh). A launcher still naming
``.venv``'s interpreter would run without vLLM, and verl's ``vllm`` rollout would be refused at start-up."""

from __future__ import annotations

import sys
from pathlib import Path

BIN = Path(sys.executable).parent


def test_the_areal_plugins_launcher_runs_this_environments_interpreter():
    shebang = (BIN / "areal-plugins").read_text().splitlines()[0]
    assert Path(shebang.removeprefix("#!")).parent == BIN, shebang


def test_activating_the_environment_puts_its_own_bin_first():
    assert f'VIRTUAL_ENV="{BIN.parent}"' in (BIN / "activate").read_text()
