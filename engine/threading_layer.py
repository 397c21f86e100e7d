"""Which thread pool numba's parallel kernels run on, chosen before numba starts.

A decode token is ~40 short parallel launches, so how idle workers wait
decides the speed. Workers that sleep at once pay a futex wake-up per launch;
workers that spin make launches cheap on a quiet machine but collapse when
another process holds a core (a launch waits for the worker the scheduler
parked). So by default tierlab runs OpenMP with libgomp's spin between
launches and has the engine use only the CPUs other processes leave free
(engine/load_follow.py): the spinning pool's speed when quiet, and no launch
waiting on a descheduled worker under load (docs/engine.md, "Threads").

Rule: a user who names a layer (NUMBA_THREADING_LAYER) or an OpenMP wait
setting (OMP_WAIT_POLICY, GOMP_SPINCOUNT) gets exactly that, with a fixed
thread count; otherwise OpenMP with the spin and the load-following thread
count (at most NUMBA_NUM_THREADS) when libgomp loads, else TBB (its workers
spin briefly, then sleep), else numba's own choice. TIERLAB_FOLLOW_LOAD=0
keeps the default pool with every thread.
"""

from __future__ import annotations

import ctypes
import os
import site
import sys
from pathlib import Path

#: tierlab's default: OpenMP, idle workers spinning libgomp's default 300,000 rounds between
#: launches, then sleeping (so a worker the load-follower leaves idle stops spinning soon)
DEFAULT = {"NUMBA_THREADING_LAYER": "omp", "GOMP_SPINCOUNT": "300000"}
#: written beside DEFAULT: "follow" says the settings are tierlab's own, not a user's, so a
#: child process (a benchmark's, a sweep's) makes the same choice
MARKER = "TIERLAB_THREADING"

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


def omp_loads() -> bool:
    """Whether numba's OpenMP pool and libgomp load here (checked without importing numba,
    which reads its configuration on import)."""
    import importlib.util

    spec = importlib.util.find_spec("numba")
    if spec is None or not spec.origin:
        return False
    for lib in (Path(spec.origin).parent / "np" / "ufunc").glob("omppool*.so"):
        try:
            ctypes.CDLL(str(lib))
            return True
        except OSError:
            continue
    return False


def _is_own_default(environ) -> bool:
    """The environment holds tierlab's default exactly as a parent tierlab wrote it."""
    return (environ.get(MARKER) == "follow" and "OMP_WAIT_POLICY" not in environ
            and all(environ.get(k) == v for k, v in DEFAULT.items()))


def choose(environ=os.environ) -> str:
    """Decide the layer, write it into ``environ``, and return its name.

    Runs on `import tierlab`, before numba reads its configuration.
    """
    if _is_own_default(environ):
        return "omp"
    environ.pop(MARKER, None)  # a marker beside a user's own settings means nothing
    named = environ.get("NUMBA_THREADING_LAYER")
    if named:
        if named == "tbb":
            preload_tbb()
        return named
    if any(k in environ for k in _OMP_KEYS):
        environ["NUMBA_THREADING_LAYER"] = "omp"
        return "omp"
    if omp_loads():
        environ.update(DEFAULT)
        environ[MARKER] = "follow"
        return "omp"
    if preload_tbb():
        environ["NUMBA_THREADING_LAYER"] = "tbb"
        return "tbb"
    return "default"


def follows_load(environ=os.environ) -> bool:
    """Whether the engine's thread count follows the load: on tierlab's own default only
    (NUMBA_NUM_THREADS, where set, is the most it uses)."""
    return _is_own_default(environ)


def describe(environ=os.environ) -> str:
    """One line for benchmark reports: the layer, any OpenMP wait settings, and whether the
    thread count follows the load."""
    layer = environ.get("NUMBA_THREADING_LAYER", "default")
    omp = " ".join(f"{k}={environ[k]}" for k in _OMP_KEYS if environ.get(k))
    follow = ", threads follow the load" if follows_load(environ) else ""
    return f"threading {layer}" + (f" ({omp})" if omp else "") + follow
