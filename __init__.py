"""tierlab: cache-aware routing lab for Mixture-of-Experts LLMs with tiered experts."""

import os
from pathlib import Path

# numba's parallel kernels run on OpenMP. A spinning worker on a shared 2-core
# machine steals the core its partner needs (a 100-microsecond kernel took
# 8 ms), so workers wait passively; but waking a sleeping worker costs ~18 us
# per launch, a third of an int4 expert matvec, so they spin 1000 rounds
# first (~40 us of CPU after each kernel; back-to-back launches ~3.5 us).
# Both must be set before numba starts its pool, so they are set on import.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("GOMP_SPINCOUNT", "1000")

__version__ = "0.1.0"

#: Folder that holds the shipped models (the repository's assets/ folder).
ASSETS_DIR = Path(__file__).resolve().parent / "assets"
