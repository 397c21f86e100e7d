"""tierlab.widgets."""
