#!/usr/bin/env bash
# The README's test command: set up .venv, lint, then the unit and integration suites.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh
.venv/bin/ruff check areal_plugins tests tools
.venv/bin/ruff format --check areal_plugins tests tools
.venv/bin/mypy areal_plugins
.venv/bin/python -m pytest tests/unit -q
.venv/bin/python -m pytest tests/integration -m integration -q -p no:cacheprovider
