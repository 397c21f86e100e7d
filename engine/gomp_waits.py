"""libgomp's idle workers made to sleep at once, switched on and off while the process runs.

Why: tierlab's default pool spins between launches (GOMP_SPINCOUNT=300000), which
makes decode's short launches cheap. libgomp reads that count once, at start. A
prompt under load wants the opposite: every thread working, and a thread that
waits at a barrier sleeping at once so the thread it waits for gets the core
(OMP_WAIT_POLICY=PASSIVE's behaviour, docs/engine.md "Threads").

How: libgomp has a second spin count, 100 rounds when OMP_WAIT_POLICY is unset,
which every wait uses instead of GOMP_SPINCOUNT while libgomp manages more threads
than the process has CPUs (the check is made at each wait). Each thread that has
opened an OpenMP team keeps that team's workers until it exits, and they count as
managed. So a parked helper thread that opens a team of its own lifts the count
past the CPUs, and every wait in the process is short until the helper exits and
libgomp frees its team. Nothing is computed on the helper's team.
"""

from __future__ import annotations

import threading

import numba
import numpy as np
from numba import njit, prange


@njit("void(int64[::1])", parallel=True, nogil=True, cache=True)
def _open_team(marks):
    """One launch: as many threads as the calling thread's numba count, each marking its item."""
    for i in prange(marks.size):
        marks[i] = i


class ShortWaits:
    """Engage / release the short waits; one per process (its state is libgomp's).

    `cpus`: the CPUs the process may run on when libgomp started (its count of available
    CPUs); `team_threads`: the most threads the engine's own launches use. The helper's team
    must lift the managed count past the CPUs: it needs cpus - team_threads + 2 threads, which
    numba allows up to NUMBA_NUM_THREADS; beyond that the switch is unavailable."""

    def __init__(self, cpus: int, team_threads: int) -> None:
        self.helper_threads = max(2, cpus - team_threads + 2)
        self.available = self.helper_threads <= numba.config.NUMBA_NUM_THREADS
        self._lock = threading.Lock()
        self._helper: threading.Thread | None = None
        self._release = threading.Event()
        self.engagements = 0  # how often the short waits were switched on

    @property
    def engaged(self) -> bool:
        return self._helper is not None

    def engage(self) -> bool:
        """Short waits from now on (idempotent); False where unavailable, or where the helper
        could not start or open its team (then never tried again: the caller keeps its
        followed thread count, which is correct, only slower under load)."""
        if self._helper is not None:  # engaged: every layer of a loaded prompt asks again
            return True
        if not self.available:
            return False
        with self._lock:
            if self._helper is not None:
                return True
            ready, opened = threading.Event(), []
            self._release.clear()
            helper = threading.Thread(target=self._park, args=(ready, opened), name="tierlab-short-waits",
                                      daemon=True)
            try:
                helper.start()
            except RuntimeError:  # no thread to be had
                self.available = False
                return False
            ready.wait()
            if not opened:
                helper.join()
                self.available = False
                return False
            self._helper = helper
            self.engagements += 1
            return True

    def release(self) -> None:
        """Back to the spin: the helper exits and libgomp frees its team."""
        with self._lock:
            if self._helper is None:
                return
            self._release.set()
            self._helper.join()
            self._helper = None

    def _park(self, ready: threading.Event, opened: list) -> None:
        try:
            numba.set_num_threads(self.helper_threads)  # this thread's count only
            _open_team(np.zeros(self.helper_threads, np.int64))
            opened.append(True)
        except Exception:  # reported by engage's False; the prompt runs as before
            return
        finally:
            ready.set()
        self._release.wait()
