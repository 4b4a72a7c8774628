"""``python -m areal_plugins.cli``: the same as the ``areal-plugins`` command."""

from __future__ import annotations

from areal_plugins.cli import main

if __name__ == "__main__":  # a module walk (the seam test) imports it without running the CLI
    raise SystemExit(main())
