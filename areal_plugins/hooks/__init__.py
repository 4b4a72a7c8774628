"""The plugin system: hook specifications, the contracts of what the rollout hooks return (``contracts.py``),
the marker plugin authors use, and the plugin manager."""
