"""How fast the converter quantises: the numpy reference against its compiled twin (docs/benchmarks.md, Converter)."""
import time, numpy as np
from tierlab.engine.quant import quantize, quantize_fast
w = np.random.default_rng(0).standard_normal((512, 2048)).astype(np.float32)
quantize_fast(w, 4)
def t(f, n):
    best = 1e9
    for _ in range(n):
        t0 = time.perf_counter(); f(w, 4); best = min(best, time.perf_counter() - t0)
    return best
a, b = t(quantize, 3), t(quantize_fast, 5)
print(f"512x2048 int4: numpy reference {w.size / a / 1e6:.0f} Mweights/s, compiled {w.size / b / 1e6:.0f} Mweights/s ({a / b:.1f}x); best of 3 / 5")
