"""The thread-pool choice made on `import tierlab`: TBB by default, a user's setting as given."""

import json
import os
import subprocess
import sys

import pytest

from tierlab.engine import threading_layer

_PROBE = """
import json, os, tierlab, numba, numpy as np
from numba import njit, prange
@njit(parallel=True)
def total(a):
    s = 0.0
    for i in prange(a.size):
        s += a[i]
    return s
total(np.ones(64))
print(json.dumps({"layer": numba.threading_layer(),
                  "spin": os.environ.get("GOMP_SPINCOUNT"),
                  "policy": os.environ.get("OMP_WAIT_POLICY")}))
"""


def _probe(**overrides):
    env = {k: v for k, v in os.environ.items()
           if k not in ("NUMBA_THREADING_LAYER", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env.update(overrides)
    out = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_user_layer_is_kept():
    env = {"NUMBA_THREADING_LAYER": "workqueue"}
    assert threading_layer.choose(env) == "workqueue"
    assert "GOMP_SPINCOUNT" not in env and "OMP_WAIT_POLICY" not in env


def test_user_wait_policy_is_kept_as_given():
    # ACTIVE alone must spin as libgomp spins for ACTIVE: no spin count of ours beside it
    env = {"OMP_WAIT_POLICY": "ACTIVE"}
    assert threading_layer.choose(env) == "omp"
    assert env == {"OMP_WAIT_POLICY": "ACTIVE", "NUMBA_THREADING_LAYER": "omp"}


def test_fallback_without_tbb_is_short_spin_omp(monkeypatch):
    monkeypatch.setattr(threading_layer, "preload_tbb", lambda: False)
    env = {}
    assert threading_layer.choose(env) == "omp"
    assert env == {**threading_layer.OMP_FALLBACK, "NUMBA_THREADING_LAYER": "omp"}


@pytest.mark.skipif(not threading_layer.preload_tbb(), reason="the tbb wheel is not installed on this platform")
def test_default_process_runs_on_tbb():
    got = _probe()
    assert got == {"layer": "tbb", "spin": None, "policy": None}


def test_process_with_omp_setting_runs_on_omp_as_given():
    got = _probe(OMP_WAIT_POLICY="ACTIVE")
    assert got == {"layer": "omp", "spin": None, "policy": "ACTIVE"}
