"""libgomp's short waits, switched on and off at run time: idle workers stop spinning while they
are engaged and spin again once released."""

import json
import os
import subprocess
import sys

import pytest

from tierlab.engine import threading_layer
from tierlab.engine.gomp_waits import ShortWaits

# CPU time per launch of a process that launches a 2-thread team, then idles 10 ms: with the
# spin, the idle worker burns up to GOMP_SPINCOUNT rounds (milliseconds) after each launch
_PROBE = """
import json, os, time, tierlab, numba, numpy as np
from tierlab.engine.gomp_waits import ShortWaits, _open_team
numba.set_num_threads(2)
marks = np.zeros(64, np.int64)
def idle_cpu_ms(n=25):
    t0 = time.process_time()
    for _ in range(n):
        _open_team(marks)
        time.sleep(0.01)
    return (time.process_time() - t0) / n * 1e3
waits = ShortWaits(len(os.sched_getaffinity(0)), numba.config.NUMBA_NUM_THREADS)
_open_team(marks)
spin = idle_cpu_ms()
waits.engage()
engaged = idle_cpu_ms()
waits.release()
released = idle_cpu_ms()
print(json.dumps({"available": waits.available, "spin": spin, "engaged": engaged, "released": released,
                  "layer": numba.threading_layer()}))
"""


def _run_probe():
    env = {k: v for k, v in os.environ.items()
           if k not in ("NUMBA_THREADING_LAYER", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "NUMBA_NUM_THREADS",
                        threading_layer.MARKER)}
    out = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not threading_layer.omp_loads() or len(os.sched_getaffinity(0)) < 2,
                    reason="needs libgomp and two CPUs")
def test_engaged_waits_stop_the_idle_spin_and_released_ones_spin_again():
    got = _run_probe()
    assert got["layer"] == "omp" and got["available"]
    assert got["spin"] > 0.3, got  # the spin is there to switch off (~3-5 ms here)
    assert got["engaged"] < got["spin"] / 4, got
    assert got["released"] > 2 * got["engaged"], got


def test_the_helper_team_must_lift_the_count_past_the_cpus():
    assert ShortWaits(cpus=2, team_threads=2).helper_threads == 2
    assert ShortWaits(cpus=16, team_threads=16).helper_threads == 2
    assert ShortWaits(cpus=16, team_threads=4).helper_threads == 14
    assert not ShortWaits(cpus=10**6, team_threads=1).available  # beyond NUMBA_NUM_THREADS


def test_engage_and_release_are_idempotent():
    waits = ShortWaits(cpus=2, team_threads=2)
    if not waits.available:
        pytest.skip("NUMBA_NUM_THREADS below 2")
    assert waits.engage() and waits.engage() and waits.engaged and waits.engagements == 1
    waits.release()
    waits.release()
    assert not waits.engaged
    assert waits.engage() and waits.engagements == 2
    waits.release()


def test_a_helper_that_cannot_open_its_team_leaves_the_waits_as_they_are(monkeypatch):
    from tierlab.engine import gomp_waits

    def refuse(marks):
        raise RuntimeError("no team here")

    monkeypatch.setattr(gomp_waits, "_open_team", refuse)
    waits = ShortWaits(cpus=2, team_threads=2)
    if not waits.available:
        pytest.skip("NUMBA_NUM_THREADS below 2")
    assert not waits.engage() and not waits.engaged and not waits.available
    assert not waits.engage() and waits.engagements == 0  # not tried again
    waits.release()  # nothing to release
