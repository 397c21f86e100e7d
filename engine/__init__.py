"""tierlab.engine."""
