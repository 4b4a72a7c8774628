"""Test-wide setup: this suite runs verl on the CPU platform (no accelerator on CI)."""

from __future__ import annotations

import os

# Before anything imports verl: the platform singleton is resolved once per process.
os.environ.setdefault("VERL_PLATFORM", "cpu")
