"""tierlab: cache-aware routing lab for Mixture-of-Experts LLMs with tiered experts."""

import os
from pathlib import Path

# A spinning OpenMP worker on a 2-core machine steals the core its partner needs:
# numba's parallel kernels must wait passively. This must be set before numba
# starts its thread pool, so it is set when the package is imported.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# ... but waking a sleeping worker costs ~18 us per kernel launch: spin briefly
# first (see engine/kernels/qmatvec.py).
os.environ.setdefault("GOMP_SPINCOUNT", "1000")

__version__ = "0.1.0"

#: Folder that holds the shipped models (the repository's assets/ folder).
ASSETS_DIR = Path(__file__).resolve().parent / "assets"
