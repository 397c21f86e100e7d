"""Measurements built on the engine: evaluation, A/B tables, the Belady bound, benchmarks, tier planning.

Nothing in `tierlab.engine` imports this package: the hot path stays free of it.
"""
