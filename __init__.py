"""tierlab: cache-aware routing lab for Mixture-of-Experts LLMs with tiered experts."""

import os
from pathlib import Path

# numba's parallel kernels: which thread pool, and how its idle workers wait,
# decides decode speed on a quiet machine and on a loaded one alike. The
# choice (OpenMP that spins, with a thread count that follows the load; TBB
# without libgomp; a user's own setting wins) must be made before numba
# starts its pool: see engine/threading_layer.py and docs/engine.md, "Threads".
from tierlab.engine import threading_layer as _threading_layer

THREADING_LAYER = _threading_layer.choose()

# numba's disk cache: a folder in the user's cache keyed by the kernels'
# sources, so an installed package caches too and a change in one module
# never leaves stale machine code in another (engine/kernel_cache.py).
from tierlab.engine import kernel_cache as _kernel_cache

KERNEL_CACHE_DIR = _kernel_cache.choose()

__version__ = "0.1.0"

#: Folder that holds the shipped models (the repository's assets/ folder).
ASSETS_DIR = Path(__file__).resolve().parent / "assets"
