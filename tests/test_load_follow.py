"""The engine's thread count follows the machine's load, and the logits never depend on it."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import numba
import numpy as np
import pytest

from tierlab import ASSETS_DIR
from tierlab.engine import load_follow
from tierlab.engine.load_follow import LoadFollower
from tierlab.engine.model import load_engine
from tierlab.engine.tiering import TierOptions

HZ = 100


class FakeMachine:
    """/proc/stat of a 2-CPU machine, a clock and this process's CPU time, moved by hand."""

    def __init__(self, path):
        self.path = path
        self.now = 0.0
        self.busy = [0, 0]
        self.own = 0.0
        self.write()

    def write(self):
        lines = ["cpu  0 0 0 0 0 0 0 0 0 0"]
        lines += [f"cpu{i} {b} 0 0 1000 0 0 0 0 0 0" for i, b in enumerate(self.busy)]
        self.path.write_text("\n".join(lines + ["intr 0", "ctxt 0"]) + "\n")

    def run(self, seconds, ours, others):
        """`seconds` of wall time with this process using `ours` CPUs and the others `others`."""
        self.now += seconds
        self.own += ours * seconds
        ticks = (ours + others) * seconds * HZ
        self.busy = [b + int(round(ticks / 2)) for b in self.busy]
        self.write()

    def follower(self):
        return LoadFollower(2, {0, 1}, stat_path=self.path, clock=lambda: self.now, own_cpu_s=lambda: self.own,
                            ticks_per_s=HZ)


def test_a_competing_process_takes_a_thread_and_gives_it_back(tmp_path):
    m = FakeMachine(tmp_path / "stat")
    f = m.follower()
    assert f.enabled and f.update() == 2
    m.run(0.5, ours=2.0, others=0.0)
    assert f.update() == 2  # quiet: every CPU
    m.run(0.5, ours=1.0, others=1.0)
    assert f.update() == 1 and f.others == pytest.approx(1.0, abs=0.05)
    m.run(0.5, ours=1.0, others=0.5)
    assert f.update() == 1  # half a CPU still taken: the hysteresis keeps one thread
    m.run(0.5, ours=1.0, others=0.1)
    assert f.update() == 2 and f.switches == 2


def test_the_load_is_read_at_most_every_sample_interval(tmp_path):
    m = FakeMachine(tmp_path / "stat")
    f = m.follower()
    m.run(load_follow.SAMPLE_S / 2, ours=1.0, others=1.0)
    assert f.update() == 2  # too soon to read again
    m.run(load_follow.SAMPLE_S, ours=1.0, others=1.0)
    assert f.update() == 1


def test_without_a_line_for_each_cpu_the_threads_stay_fixed(tmp_path):
    stat = tmp_path / "stat"
    stat.write_text("cpu  1 2 3 4\ncpu0 1 0 0 10 0 0 0 0\n")
    f = LoadFollower(2, {0, 1}, stat_path=stat)
    assert not f.enabled and f.update() == 2
    assert not LoadFollower(2, {0, 1}, stat_path=tmp_path / "missing").enabled
    assert not LoadFollower(1, {0}).enabled  # one thread: nothing to follow


def test_a_prompt_under_load_runs_every_thread_with_short_waits(tmp_path):
    m = FakeMachine(tmp_path / "stat")
    f = m.follower()
    m.run(1.0, ours=1.0, others=1.0)  # another process holds a CPU
    try:
        f.follow()
        assert numba.get_num_threads() == 1 and not f.short_waits.engaged  # decode: one thread, the spin
        with f.prompt():
            f.follow()
            assert numba.get_num_threads() == 2 and f.short_waits.engaged
        assert not f.short_waits.engaged  # released with the last prompt
        assert f.describe().endswith("short waits in 1 prompt")
        f.follow()
        assert numba.get_num_threads() == 1
        m.run(1.0, ours=2.0, others=0.0)  # quiet again
        with f.prompt():
            f.follow()
            assert numba.get_num_threads() == 2 and not f.short_waits.engaged  # quiet prompts keep the spin
    finally:
        f.short_waits.release()
        numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)


def test_without_the_follower_a_prompt_changes_nothing(tmp_path):
    f = LoadFollower(2, {0, 1}, enabled=False)
    with f.prompt():
        f.follow()
    assert f.short_waits is None


def test_the_real_proc_stat_sees_another_process_burn_cpu():
    """On this machine: what a child burns shows up as the others' load (at least most of it;
    anything else running only adds)."""
    f = LoadFollower(2, os.sched_getaffinity(0))  # the child inherits this mask
    if not f.enabled:
        pytest.skip("a /proc/stat without this machine's CPUs")
    burn = "import time, resource\nt=time.time()\nwhile time.time()-t<0.8: pass\n" \
           "r=resource.getrusage(resource.RUSAGE_SELF); print(r.ru_utime+r.ru_stime)"
    f._last = f._reading()
    start = time.monotonic()
    child_cpu = float(subprocess.run([sys.executable, "-c", burn], capture_output=True, text=True,
                                     check=True).stdout.split()[-1])
    time.sleep(max(0.0, load_follow.SAMPLE_S - (time.monotonic() - start)))
    f.update()
    wall = time.monotonic() - start
    assert f.others >= 0.7 * child_cpu / wall - 0.05


def test_the_engine_runs_with_the_followers_count_and_the_logits_do_not_change(tmp_path):
    engine = load_engine(ASSETS_DIR / "tiny-moe", tier=TierOptions(enabled=False), with_tokenizer=False)
    prompt = [int(i) for i in np.random.default_rng(3).integers(2, 250, 12)]
    try:
        numba.set_num_threads(2)
        engine.threads = LoadFollower(2, {0, 1}, enabled=False)
        engine.reset()
        quiet = [engine.prefill(prompt)] + [engine.step(5 + i) for i in range(6)]
        m = FakeMachine(tmp_path / "stat")
        engine.threads = m.follower()
        m.run(1.0, ours=1.0, others=1.0)  # another process holds a CPU
        engine.reset()
        busy = [engine.prefill(prompt)] + [engine.step(5 + i) for i in range(6)]
        assert numba.get_num_threads() == 1
        # the prompt ran every thread with short waits, released before decode
        assert engine.threads.short_waits.engagements == 1 and not engine.threads.short_waits.engaged
        for a, b in zip(quiet, busy):
            np.testing.assert_array_equal(a, b)
    finally:
        numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
        engine.close()
