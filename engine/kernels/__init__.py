"""tierlab.engine.kernels."""
