"""The thread-pool choice made on `import tierlab`: spinning OpenMP whose threads follow the load by
default, a user's setting as given."""

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
           if k not in ("NUMBA_THREADING_LAYER", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", threading_layer.MARKER)}
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


def test_default_is_spinning_omp_marked_as_tierlabs_own(monkeypatch):
    monkeypatch.setattr(threading_layer, "omp_loads", lambda: True)
    env = {}
    assert threading_layer.choose(env) == "omp"
    assert env == {**threading_layer.DEFAULT, threading_layer.MARKER: "follow"}
    assert threading_layer.follows_load(env)
    assert "threads follow the load" in threading_layer.describe(env)


def test_a_child_of_tierlab_keeps_the_default_and_follows_the_load():
    env = {**threading_layer.DEFAULT, threading_layer.MARKER: "follow", "NUMBA_NUM_THREADS": "2"}
    assert threading_layer.choose(env) == "omp"
    assert env == {**threading_layer.DEFAULT, threading_layer.MARKER: "follow", "NUMBA_NUM_THREADS": "2"}
    assert threading_layer.follows_load(env)  # NUMBA_NUM_THREADS is the most it uses


def test_a_users_settings_beside_the_marker_are_the_users():
    # the same values as the default, but the user's own (no marker): a fixed thread count
    env = dict(threading_layer.DEFAULT)
    assert threading_layer.choose(env) == "omp" and not threading_layer.follows_load(env)
    env = {**threading_layer.DEFAULT, threading_layer.MARKER: "follow", "OMP_WAIT_POLICY": "ACTIVE"}
    assert threading_layer.choose(env) == "omp"
    assert threading_layer.MARKER not in env and not threading_layer.follows_load(env)


def test_without_libgomp_tbb_then_numbas_own_choice(monkeypatch):
    monkeypatch.setattr(threading_layer, "omp_loads", lambda: False)
    monkeypatch.setattr(threading_layer, "preload_tbb", lambda: True)
    env = {}
    assert threading_layer.choose(env) == "tbb" and env == {"NUMBA_THREADING_LAYER": "tbb"}
    assert not threading_layer.follows_load(env)
    monkeypatch.setattr(threading_layer, "preload_tbb", lambda: False)
    env = {}
    assert threading_layer.choose(env) == "default" and env == {}


def _omp_really_runs() -> bool:
    """Ground truth: a process told to use numba's OpenMP pool runs a parallel kernel on it."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", threading_layer.MARKER)}
    env["NUMBA_THREADING_LAYER"] = "omp"
    probe = _PROBE.replace("import json, os, tierlab,", "import json, os,")
    return subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True).returncode == 0


def test_the_libgomp_check_agrees_with_numba():
    """omp_loads() (checked without importing numba) says what numba then finds."""
    assert threading_layer.omp_loads() == _omp_really_runs()


def test_default_process_runs_on_spinning_omp():
    got = _probe()
    if threading_layer.omp_loads():
        assert got == {"layer": "omp", "spin": threading_layer.DEFAULT["GOMP_SPINCOUNT"], "policy": None}
    else:  # no libgomp here: TBB, or numba's own pool without it
        assert got["layer"] in ("tbb", "workqueue") and got["spin"] is None


def test_process_with_omp_setting_runs_on_omp_as_given():
    got = _probe(OMP_WAIT_POLICY="ACTIVE")
    assert got == {"layer": "omp", "spin": None, "policy": "ACTIVE"}
