"""tierlab.engine.models."""
