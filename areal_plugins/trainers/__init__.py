"""Deprecated: this folder moved to :mod:`areal_plugins.driver` (the driver's code) and :mod:`areal_plugins.actors`.

Only the modules the plugin guide once showed forward from here (:mod:`areal_plugins._moved`, with a
``DeprecationWarning``); import their names from :mod:`areal_plugins`.
"""
