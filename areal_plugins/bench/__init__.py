"""Benchmark-only stand-ins, used by ``tools/``: the paced engine with no model (rollout backend ``areal_paced``) and
the synchronous baseline's sampler. Not for training runs; nothing here is loaded unless a benchmark names it."""
