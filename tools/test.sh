#!/usr/bin/env bash
# The README's test command: set up .venv, lint, build the docs site, then the unit and integration suites.
# CI runs it as is: 13 verl starts that cover each layer once (CONTRIBUTING.md has their times, box by box).
# `tools/test.sh --full` also runs the tests marked `full` (CONTRIBUTING.md lists them: about 20 more verl starts,
# 1 h more).
set -euo pipefail
cd "$(dirname "$0")/.."
UNIT="not integration and not full"
INTEGRATION="integration and not full"
if [ "${1:-}" = "--full" ]; then
  UNIT="not integration"
  INTEGRATION="integration"
fi
bash tools/setup.sh
.venv/bin/ruff check areal_plugins patches tests tools
.venv/bin/ruff format --check areal_plugins patches tests tools
.venv/bin/mypy areal_plugins patches
# The documentation site, warnings as errors (a broken link, a missing page or one left out of the nav fails).
NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --quiet --site-dir "$(mktemp -d)"
# One test file per core (`--dist loadfile`: a file's tests share its fixtures, and its local Ray, in one process).
# Ray 2.60 writes a login token to ~/.ray/auth_token at a machine's first local cluster: made here, once, so two
# workers' first clusters cannot both write it while the other's processes read it (a fresh CI home has none).
# (stdout is the token itself; stderr says why, should it fail.)
.venv/bin/ray get-auth-token --generate >/dev/null
# tests/unit/test_gpu_pins.py reads the source of the vLLM a GPU run installs, fetched from the package registry
# (setup above needs it too): here an unreachable registry fails it instead of skipping it.
AREAL_GPU_PINS_REQUIRED=1 .venv/bin/python -m pytest tests/unit -m "$UNIT" -q -n auto --dist loadfile --durations=5
# Unit tests that import verl's vLLM adapter need vLLM itself: in .venv-verl-vllm (made by setup.sh). Those that
# load the tiny models (LoRA and MoE checks in a real vLLM engine) skip without them: built first (once per machine;
# the integration tier uses the same folders).
.venv/bin/python -m areal_plugins.cli build-tiny --out .areal/tiny
.venv/bin/python -m areal_plugins.cli build-tiny --workload moe --out .areal/tiny_moe
.venv-verl-vllm/bin/python -m pytest tests/verl_vllm -q -p no:cacheprovider
.venv/bin/python -m pytest tests/integration -m "$INTEGRATION" -q -p no:cacheprovider --durations=15
