"""Weight transports from the trainer to standalone rollout pools: verl checkpoint engines we register.

verl's own engines (nccl, nixl, ...) need GPUs; :mod:`.gloo` (``areal_gloo``) runs on any machine, so
the separate placement's code path is the same on a laptop, in CI and on a GPU cluster.
"""
