"""What one parallel launch costs after the engine thread was busy elsewhere for a while.

Why: between two launches the decode thread runs Python (routing, the expert store's
bookkeeping); if the pool's idle workers stop spinning and sleep before the next launch,
that launch waits for a wake-up. This times a launch of a tiny matvec (8x64 bf16, so
the launch is all there is) after the calling thread busy-waited each gap, with the
pool and waiting that the environment selects (tierlab's default unless OMP_WAIT_POLICY,
GOMP_SPINCOUNT or NUMBA_THREADING_LAYER is set):

    python tools/launch_wake.py
    OMP_WAIT_POLICY=ACTIVE GOMP_SPINCOUNT=infinite python tools/launch_wake.py
"""

from __future__ import annotations

import os
import time

import numpy as np

import tierlab  # noqa: F401  (picks numba's thread pool before numba starts it)
from tierlab.engine.kernels import qmatvec as K

GAPS_US = (0, 10, 30, 100, 300, 1000, 3000, 10000)


def main() -> None:
    import numba

    rng = np.random.default_rng(0)
    w = rng.integers(0, 1 << 16, (8, 64), dtype=np.uint16)
    x = rng.standard_normal(64).astype(np.float32)
    out = np.empty(8, np.float32)
    K.matvec_bf16(w, x, out)
    print(f"pool {numba.threading_layer()}, {numba.get_num_threads()} threads, "
          f"GOMP_SPINCOUNT={os.environ.get('GOMP_SPINCOUNT')}, OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}")
    for gap_us in GAPS_US:
        times = []
        for _ in range(300 if gap_us < 3000 else 60):
            start = time.perf_counter()
            while (time.perf_counter() - start) * 1e6 < gap_us:  # busy, as the decode thread is
                pass
            t0 = time.perf_counter()
            K.matvec_bf16(w, x, out)
            times.append(time.perf_counter() - t0)
        print(f"after {gap_us:>6} us busy: launch median {np.median(times) * 1e6:6.1f} us, "
              f"p90 {np.percentile(times, 90) * 1e6:6.1f} us")


if __name__ == "__main__":
    main()
