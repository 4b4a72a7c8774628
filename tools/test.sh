#!/usr/bin/env bash
# The README's test command: set up .venv, lint, build the docs site, then the unit and integration suites.
# `tools/test.sh --full` also runs the tests that repeat a CI guarantee at more verl starts (marker `full`, listed in
# CONTRIBUTING.md; about 10 min more).
set -euo pipefail
cd "$(dirname "$0")/.."
MARKERS="integration and not full"
if [ "${1:-}" = "--full" ]; then
  MARKERS="integration or full"
fi
bash tools/setup.sh
.venv/bin/ruff check areal_plugins patches tests tools
.venv/bin/ruff format --check areal_plugins patches tests tools
.venv/bin/mypy areal_plugins patches
# The documentation site, warnings as errors (a broken link, a missing page or one left out of the nav fails).
NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --quiet --site-dir "$(mktemp -d)"
.venv/bin/python -m pytest tests/unit -q --durations=5
# Unit tests that import verl's vLLM adapter need vLLM itself: in .venv-verl-vllm (made by setup.sh).
.venv-verl-vllm/bin/python -m pytest tests/verl_vllm -q -p no:cacheprovider
.venv/bin/python -m pytest tests/integration -m "$MARKERS" -q -p no:cacheprovider --durations=15
