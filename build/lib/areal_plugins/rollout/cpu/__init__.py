"""``areal_cpu``: a continuous-batching engine on ``transformers`` in a Ray actor (zero setup, CPU)."""
