"""The plugin API: hook specifications (``hookspecs.py``), the contracts of what the hooks return (``contracts.py``)
and the marker plugin authors use (``hookimpl.py``). The manager that loads plugins and calls hooks is
:mod:`areal_plugins.plugin_manager`; the names a plugin author needs are re-exported by :mod:`areal_plugins`."""
