"""Device platforms verl lacks, registered with ``verl.plugin.platform.PlatformRegistry`` (CPU today)."""
