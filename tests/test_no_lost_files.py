"""Nothing is lost or clobbered: heat counts add up across runs, signals and crashes; outputs are atomic."""

from __future__ import annotations

import errno
import json
import multiprocessing
import os
import signal
import stat
import subprocess
import sys
import warnings

import numpy as np
import pytest

from conftest import PYTHON, REPO, run_cli
from tierlab.app.cli.main import main as cli_main
from tierlab.engine import sessionlog
from tierlab.engine.atomic import write_atomic
from tierlab.engine.heat import HeatProfile
from tierlab.engine.heat_log import HeatLog
from tierlab.engine.knobs import Knobs
from tierlab.engine.model import load_engine
from tierlab.engine.sessionlog import read_session_log
from tierlab.engine.tiering import TierOptions

MODEL = REPO / "assets" / "tiny-moe"
LAYERS, EXPERTS = 8, 32  # the shipped tiny-moe
PROMPT = [11, 42, 7, 99, 3]
N = 6


def run_once(heat) -> np.ndarray:
    """One engine's run with HEAT_FILE = heat: greedy decode, close; returns this run's routing counts."""
    engine = load_engine(MODEL, knobs=Knobs.from_env({}), tier=TierOptions(heat_file=str(heat)))
    list(engine.generate(PROMPT, N, eos_ids=[]))
    counts = np.array(engine.heat, dtype=np.int64, copy=True)
    engine.close()
    assert not engine.notices, engine.notices
    return counts


def files_in(folder) -> set[str]:
    return {p.name for p in folder.iterdir()}


# --- heat counts ----------------------------------------------------------------


def test_nine_sequential_runs_add_up_exactly(tmp_path):
    heat = tmp_path / "run.heat"
    one = run_once(heat)
    assert one.sum() > 0
    for _ in range(8):
        assert np.array_equal(run_once(heat), one)  # greedy: every run routes the same
    assert np.array_equal(HeatProfile.read(heat, LAYERS, EXPERTS).counts, 9 * one)
    assert files_in(tmp_path) == {"run.heat", "run.heat.lock"}


def _writer(path: str, seed: int, barrier, rounds: int) -> None:
    """Open a HeatLog (it reads the file now), route, wait for the other writer, write; `rounds` times."""
    rng = np.random.default_rng(seed)
    for _ in range(rounds):
        log = HeatLog(path, 3, 5)
        for _ in range(40):
            layer = int(rng.integers(3))
            log.record(layer, rng.choice(5, size=2, replace=False))
        barrier.wait()  # both have read the same file; both write now
        assert log.write(lambda text: None) == path


def _expected(seed: int, rounds: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    counts = np.zeros((3, 5), dtype=np.int64)
    for _ in range(rounds):
        for _ in range(40):
            layer = int(rng.integers(3))
            counts[layer, rng.choice(5, size=2, replace=False)] += 1
    return counts


def test_two_concurrent_writers_end_with_the_sum(tmp_path):
    path = str(tmp_path / "shared.heat")
    HeatProfile(3, 5, np.full((3, 5), 7)).write(path)
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(2)
    rounds = 5
    procs = [ctx.Process(target=_writer, args=(path, seed, barrier, rounds)) for seed in (1, 2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    want = 7 + _expected(1, rounds) + _expected(2, rounds)
    assert np.array_equal(HeatProfile.read(path, 3, 5).counts, want)


def test_two_concurrent_cli_runs_end_with_the_sum(tmp_path):
    alone, shared = tmp_path / "alone.heat", tmp_path / "shared.heat"
    args = ["generate", "--prompt", "Once upon a time", "-n", "8"]
    assert run_cli(*args, env={"HEAT_FILE": str(alone)}).returncode == 0
    env = dict(os.environ, HEAT_FILE=str(shared))
    procs = [subprocess.Popen([PYTHON, "-m", "tierlab", *args], env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
    single = HeatProfile.read(alone, LAYERS, EXPERTS).counts
    assert single.sum() > 0
    assert np.array_equal(HeatProfile.read(shared, LAYERS, EXPERTS).counts, 2 * single)


def test_a_rewrite_keeps_the_mode(tmp_path):
    heat = tmp_path / "h.heat"
    HeatProfile(2, 3).write(heat)
    os.chmod(heat, 0o644)
    old = os.umask(0o077)  # a rewrite through a private temp file once left 0600
    try:
        log = HeatLog(str(heat), 2, 3)
        log.record(1, np.array([0, 2]))
        assert log.write(lambda text: pytest.fail(text)) == str(heat)
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(heat).st_mode) == 0o644
    assert HeatProfile.read(heat).counts.tolist() == [[0, 0, 0], [1, 0, 1]]


def test_a_new_file_gets_the_umask_mode(tmp_path):
    old = os.umask(0o022)
    try:
        write_atomic(tmp_path / "new.json", "{}\n")
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(tmp_path / "new.json").st_mode) == 0o644


def test_a_second_write_adds_only_what_was_routed_since(tmp_path):
    heat = str(tmp_path / "h.heat")
    log = HeatLog(heat, 1, 2)
    log.record(0, np.array([1]))
    log.write(print)
    log.write(print)  # e.g. close called twice
    assert HeatProfile.read(heat).counts.tolist() == [[0, 1]]


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_during_generate_keeps_the_runs_counts(tmp_path, sig, code):
    heat = tmp_path / "sig.heat"
    env = dict(os.environ, HEAT_FILE=str(heat))
    proc = subprocess.Popen([PYTHON, "-m", "tierlab", "generate", "--prompt", "Once upon a time", "-n", "500"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert proc.stdout.read(1)  # the first token is out: the engine is generating
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    err = err.decode()
    assert proc.returncode == code, err
    assert "Traceback" not in err
    counts = HeatProfile.read(heat, LAYERS, EXPERTS).counts
    per_token = counts[0].sum()
    assert per_token > 0 and (counts.sum(axis=1) == per_token).all()
    assert per_token < 4 * 500  # stopped early: fewer routings than the whole run would give (top-4)
    assert files_in(tmp_path) == {"sig.heat", "sig.heat.lock"}


def test_a_leftover_temp_and_lock_do_not_break_the_next_run(tmp_path):
    heat = tmp_path / "h.heat"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f".h.heat.{dead.pid}.x1y2.tmp"
    stale.write_bytes(b"half a profile")
    other = tmp_path / f".h.heat.{dead.pid}.{dead.pid}.x1y2.tmp"  # the temp of a file named h.heat.PID
    other.write_bytes(b"not ours")
    (tmp_path / "h.heat.lock").write_bytes(b"")
    one = run_once(heat)
    assert np.array_equal(HeatProfile.read(heat, LAYERS, EXPERTS).counts, one)
    assert files_in(tmp_path) == {"h.heat", "h.heat.lock", other.name}  # the dead process's temp is gone


# --- references, logs, convert ---------------------------------------------------


def test_a_failed_ref_write_leaves_the_old_file(tmp_path, monkeypatch, capsys):
    ref = tmp_path / "ref.json"
    ref.write_text('{"prompt_ids": [1], "full_ids": [1, 2]}\n')
    before = ref.read_bytes()
    real_fdopen = os.fdopen

    class DiskFull:
        """A file that takes half of what is written, then the disk is full."""

        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def write(self, data):
            self.f.write(data[: len(data) // 2])
            self.f.flush()
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        def __getattr__(self, name):
            return getattr(self.f, name)

    def fdopen(fd, *a, **k):
        f = real_fdopen(fd, *a, **k)
        return DiskFull(f) if os.readlink(f"/proc/self/fd/{fd}").startswith(str(tmp_path)) else f

    monkeypatch.setattr(os, "fdopen", fdopen)
    code = cli_main(["ref", "--model", str(MODEL), "--prompt-ids", "1,2,3", "-n", "3", "-o", str(ref)])
    monkeypatch.undo()
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and str(ref) in err and "No space left" in err
    assert ref.read_bytes() == before
    assert files_in(tmp_path) == {"ref.json"}


def test_ref_overwrites_an_existing_file_atomically(tmp_path):
    ref = tmp_path / "ref.json"
    ref.write_text("old")
    assert cli_main(["ref", "--model", str(MODEL), "--prompt-ids", "1,2,3", "-n", "3", "-o", str(ref)]) == 0
    data = json.loads(ref.read_text())
    assert data["prompt_ids"] == [1, 2, 3] and len(data["full_ids"]) == 6
    assert files_in(tmp_path) == {"ref.json"}


def test_log_refuses_an_existing_file_and_append_adds_to_it(tmp_path, capsys):
    log = tmp_path / "run.jsonl"
    args = ["generate", "--model", str(MODEL), "--prompt", "Hello", "-n", "4"]
    assert cli_main([*args, "--log", str(log)]) == 0
    first = log.read_bytes()
    capsys.readouterr()
    assert cli_main([*args, "--log", str(log)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(log) in err and "--append" in err
    assert log.read_bytes() == first
    assert cli_main([*args, "--log", str(log), "--append"]) == 0
    assert log.read_bytes().startswith(first)
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["type"] for r in lines].count("header") == 2 and [r["type"] for r in lines].count("summary") == 2
    once = sum(1 for line in first.decode().splitlines() if json.loads(line)["type"] == "token")
    assert len(read_session_log(log).tokens) == 2 * once
    assert cli_main(["generate", "--model", str(MODEL), "--prompt", "Hello", "-n", "1", "--append"]) == 2


def test_enospc_while_recording_is_a_notice_and_the_run_goes_on(tmp_path, monkeypatch, capsys):
    log = tmp_path / "full.jsonl"
    real_open = open
    whole = 4  # records that fit before the disk is full

    class FillsUp:
        def __init__(self, f):
            self.f, self.left = f, whole

        def write(self, text):
            if self.left == 0:
                self.f.write(text[:7])  # part of the record reaches the buffer, then the disk is full
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            self.left -= 1
            return self.f.write(text)

        def __getattr__(self, name):
            return getattr(self.f, name)

    monkeypatch.setattr(sessionlog, "open", lambda *a, **k: FillsUp(real_open(*a, **k)), raising=False)
    code = cli_main(["generate", "--model", str(MODEL), "--prompt", "Hello", "-n", "12", "--log", str(log)])
    monkeypatch.undo()
    out, err = capsys.readouterr()
    assert code == 0 and out.strip()  # the run completed and printed its text
    notices = [line for line in err.splitlines() if "session log stopped" in line]
    assert len(notices) == 1 and "No space left" in notices[0] and str(log) in notices[0]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # what was written reads back with no damage
        read = read_session_log(log)
    assert len(log.read_text().splitlines()) == whole
    assert read.header["type"] == "header" and len(read.tokens) == whole - 1


def test_convert_force_refuses_a_folder_that_is_not_a_container(tmp_path, capsys):
    out = tmp_path / "photos"
    out.mkdir()
    (out / "holiday.jpg").write_bytes(b"\xff\xd8 not a container")
    assert cli_main(["convert", "--model", str(MODEL), "--out", str(out), "--force"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(out) in err and "not a tierlab container" in err
    assert files_in(out) == {"holiday.jpg"} and (out / "holiday.jpg").read_bytes() == b"\xff\xd8 not a container"
    assert files_in(tmp_path) == {"photos"}


def test_convert_leaves_a_partial_folder_it_did_not_make(tmp_path, capsys):
    out = tmp_path / "c"
    partial = tmp_path / "c.partial"
    partial.mkdir()
    (partial / "mine.txt").write_text("keep")
    assert cli_main(["convert", "--model", str(MODEL), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(partial) in err
    assert (partial / "mine.txt").read_text() == "keep" and not out.exists()
