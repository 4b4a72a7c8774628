"""The public marker plugin authors decorate their hook implementations with."""

from __future__ import annotations

import pluggy

from areal_plugins.hooks.hookspecs import PROJECT_NAME

hookimpl = pluggy.HookimplMarker(PROJECT_NAME)
