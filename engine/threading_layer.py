"""Which thread pool numba's parallel kernels run on, chosen before numba starts.

A decode token is ~100 short parallel launches, so how idle workers wait
decides the speed. OpenMP (libgomp) offers two fixed answers and both are
wrong somewhere: workers that sleep at once pay a futex wake-up per launch
(half the decode speed on a quiet VM), workers that spin steal the core a
competing process needs (a third of the speed, or worse, under load).
oneTBB's workers spin briefly, then yield, then sleep, which follows the
machine: under load it decodes 1.07-1.35x faster than passive waiting and
several times faster than spinning; quiet, it is the best policy on one VM
type and 14-21% behind a spinning one on another (docs/engine.md, "Threads").

Rule: a user who names a layer (NUMBA_THREADING_LAYER) or an OpenMP wait
setting (OMP_WAIT_POLICY, GOMP_SPINCOUNT) gets exactly that; otherwise TBB
when its library loads, else OpenMP with a short spin.
"""

from __future__ import annotations

import ctypes
import os
import site
import sys
from pathlib import Path

#: The OpenMP fallback: passive, after a short spin (keeps back-to-back
#: launches cheap and gives a contested core back soon).
OMP_FALLBACK = {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "1000"}

_OMP_KEYS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
_TBB_SONAME = "libtbb.so.12"


def _tbb_candidates() -> list[Path]:
    """Where pip's `tbb` wheel puts its library: <prefix>/lib, not on the loader's path."""
    prefixes = dict.fromkeys([sys.prefix, sys.base_prefix, sys.exec_prefix, site.getuserbase()])
    return [Path(p) / "lib" / _TBB_SONAME for p in prefixes]


def preload_tbb() -> bool:
    """Load libtbb globally so numba's tbbpool extension finds it by soname."""
    for path in _tbb_candidates():
        if path.is_file():
            try:
                ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
                return True
            except OSError:
                continue
    try:  # already on the loader's path (a system package, LD_LIBRARY_PATH)
        ctypes.CDLL(_TBB_SONAME, mode=ctypes.RTLD_GLOBAL)
        return True
    except OSError:
        return False


def choose(environ=os.environ) -> str:
    """Decide the layer, write it into ``environ``, and return its name.

    Runs on `import tierlab`, before numba reads its configuration.
    """
    named = environ.get("NUMBA_THREADING_LAYER")
    if named:
        if named == "tbb":
            preload_tbb()
        return named
    if any(k in environ for k in _OMP_KEYS):
        environ["NUMBA_THREADING_LAYER"] = "omp"
        return "omp"
    if preload_tbb():
        environ["NUMBA_THREADING_LAYER"] = "tbb"
        return "tbb"
    environ.update(OMP_FALLBACK)
    environ["NUMBA_THREADING_LAYER"] = "omp"
    return "omp"


def describe(environ=os.environ) -> str:
    """One line for benchmark reports: the layer and any OpenMP wait settings."""
    layer = environ.get("NUMBA_THREADING_LAYER", "default")
    omp = " ".join(f"{k}={environ[k]}" for k in _OMP_KEYS if environ.get(k))
    return f"threading {layer}" + (f" ({omp})" if omp else "")
