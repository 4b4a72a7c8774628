"""The error of a weight sync that did not arrive whole: raised by senders, receivers' checks and engines."""

from __future__ import annotations


class WeightSyncError(RuntimeError):
    """The engine does not serve the weights the trainer sent."""
