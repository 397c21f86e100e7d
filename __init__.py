"""tierlab: cache-aware routing lab for Mixture-of-Experts LLMs with tiered experts."""

from pathlib import Path

__version__ = "0.1.0"

#: Folder that holds the shipped models (the repository's assets/ folder).
ASSETS_DIR = Path(__file__).resolve().parent / "assets"
