"""Runs in verl's trainer workers (the FSDP actor's Ray workers, one per trainer GPU): the decoupled PPO loss as verl's
policy loss. The weight sender these workers also run is :mod:`areal_plugins.weight_sync`."""
