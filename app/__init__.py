"""tierlab.app."""
