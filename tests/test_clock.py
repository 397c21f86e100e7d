"""The compiled code's clock (engine/kernels/clock.py) reads the same monotonic clock as
Python's perf_counter_ns on Linux, and moves forward."""

from __future__ import annotations

import time

import numpy as np
from numba import njit

from tierlab.engine.kernels.clock import monotonic_ns


@njit(nogil=True, cache=True)
def _two_readings_around_work(n):
    a = monotonic_ns()
    s = 0.0
    for i in range(n):
        s += np.sqrt(np.float64(i))
    return a, monotonic_ns(), s


def test_readings_lie_between_pythons_and_measure_the_work():
    _two_readings_around_work(10)
    before = time.perf_counter_ns()
    a, b, _ = _two_readings_around_work(2_000_000)
    after = time.perf_counter_ns()
    assert before <= a < b <= after
    assert b - a > 0.5 * (after - before) - 1e5  # the work, most of the call
