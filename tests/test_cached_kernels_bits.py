"""A process that compiles the kernels and one that loads them from numba's cache give the same bits.

Why: tests and A/B tables compare runs across processes (a CLI run against the same
run in-process, Ray workers against the serial pool), each process either compiling
the kernels or loading them from the disk cache. A blocked prompt attention once gave
other last bits once loaded from the cache; CI, which starts from an empty cache, was
the only place that saw it. Here one child starts on an empty cache folder of its own
and the next one loads what the first wrote, with a prompt and decode, every expert
in RAM and then a small cache with the routing lever on; and, kernel by kernel, the
matvecs of every weight kind, a router block's one launch and a layer's experts.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np

from tierlab import ASSETS_DIR

CHILD = """
import sys
import numpy as np
from tierlab.engine.knobs import Knobs
from tierlab.engine.model import load_engine
rows = []
# every expert in RAM (a prompt's experts grouped), then 8 slots with the routing lever on
for slots, knobs in ((None, {}), (8, {"CACHE_ROUTE": "1", "ROUTE_J": "1"})):
    engine = load_engine(sys.argv[1], cache_slots=slots, knobs=Knobs.from_env(knobs), with_tokenizer=False)
    rng = np.random.default_rng(0)
    prompt = [int(t) for t in rng.integers(0, engine.config.vocab_size, 40)]
    rows.append(engine.prefill(prompt))  # matrix-matrix products, grouped experts, DeltaNet by blocks
    for _ in range(6):  # decode: the matvecs and the one-token kernels
        rows.append(engine.step(int(np.argmax(rows[-1]))))
    engine.close()
np.save(sys.argv[2], np.stack(rows))
"""


def _logits(cache_dir, out) -> np.ndarray:
    env = {k: v for k, v in os.environ.items() if k != "TIERLAB_NUMBA_CACHE_DIR"}
    env["NUMBA_CACHE_DIR"] = str(cache_dir)  # the user's folder, used as given
    done = subprocess.run([sys.executable, "-c", CHILD, str(ASSETS_DIR / "tiny-moe"), str(out)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    return np.load(out)


def test_compiled_and_cache_loaded_kernels_give_the_same_logits(tmp_path):
    cache = tmp_path / "numba"
    compiled = _logits(cache, tmp_path / "compiled.npy")
    assert any(cache.rglob("*.nbi")), "the first process left no cached kernels"
    loaded = _logits(cache, tmp_path / "loaded.npy")
    assert compiled.shape == (14, loaded.shape[1]) and np.isfinite(compiled).all()
    np.testing.assert_array_equal(loaded, compiled)


KERNELS_CHILD = """
import sys
import numpy as np
from tierlab.engine import quant as Q
from tierlab.engine.kernels import qmatvec as K
from tierlab.engine.kernels.dense import linear
from tierlab.engine.qlinear import RowStack, quantize_matrix
rng = np.random.default_rng(7)
matvec = {"fp32": K.matvec_fp32, "bf16": K.matvec_bf16, "int8": K.matvec_int8, "int4": K.matvec_int4}
bf16 = lambda a: (a.view(np.uint32) >> 16).astype(np.uint16)
rows = []
for cols in (192, 512):  # an odd number of 64-groups, and the down projection's width
    x = rng.standard_normal(cols, dtype=np.float32)
    w = rng.standard_normal((37, cols), dtype=np.float32)  # four-row steps and rows left over
    for kind in ("fp32", "bf16", "int8", "int4"):
        out = np.empty(37, np.float32)
        if kind in ("int8", "int4"):
            m = quantize_matrix(w, 8 if kind == "int8" else 4)
            matvec[kind](m.q, m.scales, x, out)
        else:
            matvec[kind](w if kind == "fp32" else bf16(w), x, out)
        rows.append(out)
    for bits in (4, 8):  # the router block: plain rows, the quantised shared expert, a plain row, one launch
        parts = [bf16(rng.standard_normal((64, cols), dtype=np.float32)),
                 quantize_matrix(rng.standard_normal((36, cols), dtype=np.float32), bits),
                 bf16(rng.standard_normal((1, cols), dtype=np.float32))]
        rows.append(linear(RowStack(parts), x))
hidden, inter = 256, 128
x = rng.standard_normal(hidden, dtype=np.float32)
for kind in ("fp32", "bf16", "int8", "int4"):
    store = np.zeros((3, K.blob_nbytes(kind, hidden, inter)), np.uint8)
    for s in range(3):
        gate, up = (rng.standard_normal((inter, hidden), dtype=np.float32) * 0.05 for _ in range(2))
        down = rng.standard_normal((hidden, inter), dtype=np.float32) * 0.05
        if kind in ("int8", "int4"):
            store[s] = Q.build_blob(gate, up, down, 8 if kind == "int8" else 4)
        else:
            flat = np.concatenate([gate.ravel(), up.ravel(), down.ravel()])
            store[s] = (bf16(flat) if kind == "bf16" else flat).view(np.uint8)
    out = np.zeros((2, hidden), np.float32)
    K.experts_forward(kind, store, np.array([2, 0]), hidden, inter, x, out, np.array([1, 0]))
    rows.append(out.ravel())
np.save(sys.argv[1], np.concatenate(rows))
"""


def _kernel_bits(cache_dir, out) -> np.ndarray:
    env = {k: v for k, v in os.environ.items() if k != "TIERLAB_NUMBA_CACHE_DIR"}
    env["NUMBA_CACHE_DIR"] = str(cache_dir)
    done = subprocess.run([sys.executable, "-c", KERNELS_CHILD, str(out)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    return np.load(out).view(np.uint32)


def test_each_kernel_gives_the_same_bits_compiled_and_loaded_from_the_cache(tmp_path):
    """Every kernel kind on its own: a one-launch router block once gave its last row other
    last bits when loaded from the cache (the FMAs and sums were left to the backend)."""
    cache = tmp_path / "numba"
    compiled = _kernel_bits(cache, tmp_path / "compiled.npy")
    assert any(cache.rglob("*.nbi")), "the first process left no cached kernels"
    loaded = _kernel_bits(cache, tmp_path / "loaded.npy")
    assert compiled.shape == (2 * (4 * 37 + 2 * (64 + 36 + 1)) + 4 * 2 * 256,)
    assert np.isfinite(compiled.view(np.float32)).all() and (compiled != 0).mean() > 0.9
    np.testing.assert_array_equal(loaded, compiled)
