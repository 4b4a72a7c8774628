"""The pure algorithm of AReaL-style asynchronous RL: no verl, no Ray, testable on a laptop.

- :mod:`~areal_plugins.core.staleness`: the admission rule that bounds staleness (docs/design.md, "Admission").
- :mod:`~areal_plugins.core.buffer`: accepted groups, handed out oldest first.
- :mod:`~areal_plugins.core.trajectory`: one generated sample with per-token versions and log-probs.
- :mod:`~areal_plugins.core.losses`: the decoupled PPO objective.
- :mod:`~areal_plugins.core.microbatch`: token-budget micro-batches (first-fit-decreasing; runs of
  like length where micro-batches are padded).

Everything else in the package depends on this; this depends on nothing else in the package.
"""
