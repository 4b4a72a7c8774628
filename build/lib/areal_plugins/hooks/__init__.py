"""The plugin system: hook specifications, the marker plugin authors use, and the plugin manager."""
