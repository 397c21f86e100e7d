"""A process that compiles the kernels and one that loads them from numba's cache give the same bits.

Why: tests and A/B tables compare runs across processes (a CLI run against the same
run in-process, Ray workers against the serial pool), each process either compiling
the kernels or loading them from the disk cache. A blocked prompt attention once gave
other last bits once loaded from the cache; CI, which starts from an empty cache, was
the only place that saw it. Here one child starts on an empty cache folder of its own
and the next one loads what the first wrote, with a prompt and decode, every expert
in RAM and then a small cache with the routing lever on.
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
