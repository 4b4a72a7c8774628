"""Runs in verl's agent-loop workers (Ray actors, one or more per node): the rollout client that continues interrupted
requests, the per-episode records of multi-turn rollouts, and the requests kept in flight across a checkpoint.

Code here never imports :mod:`areal_plugins.driver` (``tests/unit/test_architecture.py``)."""
