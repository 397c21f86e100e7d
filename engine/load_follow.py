"""How many threads the engine's parallel kernels use: all the CPUs other processes leave free.

Why: a decode token is some forty short parallel launches. Workers that spin between
launches make them cheap on a quiet machine (docs/engine.md, "Threads"), but when another
process holds a core, a launch waits for a worker the scheduler has parked while the
spinning one burns the time the other process needed: spinning pools fall to a third of
their speed. Following the load keeps the spinning pool and gives a busy core back: with
another process using a CPU, the engine runs one thread fewer, so no launch waits for a
worker that is not running.

The load is measured, not guessed: over each interval of at least SAMPLE_S of wall time,
the busy time of the CPUs this process may run on (/proc/stat, steal included) minus this
process's own CPU time is what the other processes used. A prompt is the exception
(`LoadFollower.prompt`): under load it runs every thread with libgomp's waits made short
(engine/gomp_waits.py), as PASSIVE would. The kernels' results do not
depend on the thread count (tests/test_load_follow.py), so following the load changes
the speed only, never a logit.
"""

from __future__ import annotations

import math
import os
import threading
import time
from contextlib import contextmanager
from pathlib import Path

from tierlab.engine.gomp_waits import ShortWaits

#: seconds of wall time between two readings of the load
SAMPLE_S = 0.25
#: a thread is given up when the CPUs left free fall this far below the threads in use ...
DROP_BELOW = 0.6
#: ... and taken back when they are within this of one more thread (hysteresis between)
RAISE_WITHIN = 0.3
#: environment switch: "0" keeps every thread whatever the load
ENV_NAME = "TIERLAB_FOLLOW_LOAD"
PROC_STAT = Path("/proc/stat")


def _busy_ticks(text: str, cpus: set[int]) -> int | None:
    """Busy clock ticks (user, nice, system, irq, softirq, steal) of `cpus`, from /proc/stat's
    text; None when a CPU has no line there (a /proc that does not show this machine's CPUs)."""
    total, seen = 0, set()
    for line in text.splitlines():
        if not line.startswith("cpu") or line.startswith("cpu "):
            continue
        name, *fields = line.split()
        try:
            cpu = int(name[3:])
        except ValueError:
            continue
        if cpu not in cpus:
            continue
        v = [int(f) for f in fields[:8]] + [0] * max(0, 8 - len(fields))
        user, nice, system, _idle, _iowait, irq, softirq, steal = v
        total += user + nice + system + irq + softirq + steal
        seen.add(cpu)
    return total if seen == cpus else None


def _own_cpu_s() -> float:
    t = os.times()
    return t.user + t.system


class LoadFollower:
    """The thread count the next parallel launch should use; `follow()` applies it.

    One per process (`for_process`): the load is the machine's, the setting numba's,
    which numba keeps per launching thread, so each thread that runs the engine applies
    the current count before its launches."""

    def __init__(self, max_threads: int, cpus: set[int], enabled: bool = True, stat_path: Path = PROC_STAT,
                 clock=time.monotonic, own_cpu_s=_own_cpu_s, ticks_per_s: float | None = None) -> None:
        self.max_threads = max(1, int(max_threads))
        self.cpus = set(cpus)
        self._stat_path = stat_path
        self._clock = clock
        self._own_cpu_s = own_cpu_s
        self._hz = float(ticks_per_s or os.sysconf("SC_CLK_TCK"))
        self.threads = self.max_threads
        self.switches = 0  # how often the count changed
        self.others = 0.0  # CPUs the other processes used in the last interval
        self._applied = threading.local()
        self._lock = threading.Lock()
        self._last = self._reading() if enabled else None
        self.enabled = enabled and self._last is not None and self.max_threads > 1
        self._prompts = 0  # prompts running now, in any thread
        self.short_waits = ShortWaits(len(self.cpus), self.max_threads) if self.enabled else None

    def _reading(self) -> tuple[float, int, float] | None:
        try:
            busy = _busy_ticks(self._stat_path.read_text(), self.cpus)
        except OSError:
            return None
        return None if busy is None else (self._clock(), busy, self._own_cpu_s())

    def update(self) -> int:
        """The thread count, read again from the load once SAMPLE_S has passed since the last reading."""
        if not self.enabled or self._clock() - self._last[0] < SAMPLE_S:
            return self.threads
        with self._lock:
            if self._clock() - self._last[0] < SAMPLE_S:
                return self.threads
            now = self._reading()
            if now is None:
                self.enabled, self.threads = False, self.max_threads
                return self.threads
            wall = now[0] - self._last[0]
            others = max(0.0, ((now[1] - self._last[1]) / self._hz - (now[2] - self._last[2])) / wall)
            self._last, self.others = now, others
            free = len(self.cpus) - others
            want = self.threads
            if free < self.threads - DROP_BELOW:
                want = math.floor(free + DROP_BELOW)
            elif free >= self.threads + 1 - RAISE_WITHIN:
                want = math.floor(free + RAISE_WITHIN)
            want = max(1, min(self.max_threads, want))
            if want != self.threads:
                self.threads = want
                self.switches += 1
            return self.threads

    def follow(self) -> None:
        """Before a launch: this thread's numba thread count set to the current one (in a
        prompt under load, every thread with short waits: `prompt`)."""
        if not self.enabled:
            return
        n = self.update()
        if n < self.max_threads and getattr(self._applied, "prompt", False) and self.short_waits.engage():
            n = self.max_threads
        if getattr(self._applied, "n", None) != n:
            import numba

            numba.set_num_threads(n)
            self._applied.n = n

    @contextmanager
    def prompt(self):
        """While this thread runs a prompt: under load, every thread, with libgomp's waits short.

        Why: a prompt's launches are long and few, so a spinning pool gains nothing there,
        and one thread fewer leaves a core's share unused; every thread with waits that
        sleep at once takes the share PASSIVE takes (docs/engine.md, "Threads"). Decode's
        short launches keep the spin and the followed count. The short waits end with the
        last prompt running in the process."""
        if not self.enabled:
            yield
            return
        with self._lock:
            self._prompts += 1
        self._applied.prompt = True
        try:
            yield
        finally:
            self._applied.prompt = False
            with self._lock:
                self._prompts -= 1
                last = self._prompts == 0
            if last:
                self.short_waits.release()

    def describe(self) -> str:
        """Where the count stands, for reports ("" when it does not follow the load)."""
        if not self.enabled:
            return ""
        line = f"{self.threads} of {self.max_threads} now, {self.switches} changes"
        engaged = self.short_waits.engagements
        return line + (f", short waits in {engaged} prompt{'s' if engaged > 1 else ''}" if engaged else "")


_PROCESS: LoadFollower | None = None
_PROCESS_LOCK = threading.Lock()


def for_process(environ=os.environ) -> LoadFollower:
    """This process's follower: on with tierlab's default pool (engine/threading_layer.py),
    at most NUMBA_NUM_THREADS threads; off where the user chose the pool or its waiting, or
    set TIERLAB_FOLLOW_LOAD=0."""
    global _PROCESS
    with _PROCESS_LOCK:
        if _PROCESS is None:
            import numba

            from tierlab.engine import threading_layer

            cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))
            on = environ.get(ENV_NAME, "1") != "0" and threading_layer.follows_load(environ)
            _PROCESS = LoadFollower(numba.config.NUMBA_NUM_THREADS, cpus, enabled=on)
        return _PROCESS
