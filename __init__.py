"""tierlab: cache-aware routing lab for Mixture-of-Experts LLMs with tiered experts."""

import os
from pathlib import Path

# numba's parallel kernels run on OpenMP. A spinning worker on a shared machine
# steals the core its partner needs, so workers wait passively; waking a
# sleeping worker costs a sizeable share of an expert matvec, so they spin a
# short while first (see docs/engine.md, OpenMP waiting). numba reads both
# when it starts its pool, so they are set on import.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("GOMP_SPINCOUNT", "1000")

__version__ = "0.1.0"

#: Folder that holds the shipped models (the repository's assets/ folder).
ASSETS_DIR = Path(__file__).resolve().parent / "assets"
