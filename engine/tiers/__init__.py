"""tierlab.engine.tiers."""
