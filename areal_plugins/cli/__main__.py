"""``python -m areal_plugins.cli``: the same as the ``areal-plugins`` command."""

from __future__ import annotations

from areal_plugins.cli import main

raise SystemExit(main())
