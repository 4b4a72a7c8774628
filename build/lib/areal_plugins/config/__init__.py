"""The ``areal:`` node: its settings (one dataclass per feature), how they drive verl's keys, and the
Hydra config group ``areal/default.yaml`` that recipes include (``pkg://areal_plugins.config``)."""
