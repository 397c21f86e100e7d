"""The app's error paths: a bad heat profile or session log is one notification and the app keeps
running; SIGTERM closes the engine, so the run's heat counts are written."""

from __future__ import annotations

import json
import os
import signal
import time

import numpy as np

from fuzzing import MODEL
from tierlab.app.cli.main import main as cli_main
from tierlab.app.tui.app import TierlabApp
from tierlab.app.tui.heat_screen import HeatInspector
from tierlab.app.tui.sessions_screen import SessionsScreen
from tierlab.engine.heat import HeatProfile
from tierlab.engine.options import EngineOptions
from tierlab.engine.tiering import TierOptions
from textual.widgets import Input

from test_app import record_notes


def make_app(tmp_path, heat=None) -> TierlabApp:
    options = EngineOptions(MODEL, 6, TierOptions.from_env(enabled=False, heat_file=str(heat) if heat else None))
    app = TierlabApp(options, sessions_dir=tmp_path / "sessions")
    return record_notes(app)


async def wait_for(pilot, condition, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        await pilot.pause(0.05)


def errors(app) -> list[str]:
    return [text for text, severity in app.notes if severity == "error"]


async def test_bad_heat_files_are_one_notification_each_and_the_app_keeps_running(tmp_path):
    fifo = tmp_path / "pipe.heat"
    os.mkfifo(fifo)
    folder = tmp_path / "folder.heat"
    folder.mkdir()
    short = tmp_path / "short.heat"
    HeatProfile(8, 32).write(short)
    short.write_bytes(short.read_bytes()[:-4])
    app = make_app(tmp_path)
    async with app.run_test(size=(160, 48)) as pilot:
        await wait_for(pilot, lambda: app.engine is not None)
        await pilot.press("f2")
        await pilot.pause()
        screen = app.screen
        assert isinstance(screen, HeatInspector)
        for path, needle in ((fifo, "FIFO"), (folder, "a directory"), (short, "truncated"), ("/dev/zero", "character device")):
            before = len(errors(app))
            screen.query_one("#heat-path-a", Input).value = str(path)
            screen.query_one("#heat-path-a", Input).focus()
            await pilot.press("enter")
            await wait_for(pilot, lambda: len(errors(app)) > before, timeout=10)
            line = errors(app)[-1]
            assert "\n" not in line and str(path) in line and needle in line, line
        assert app.is_running and isinstance(app.screen, HeatInspector)


async def test_a_bad_session_log_in_the_ab_screen_is_a_notification(tmp_path, capsys):
    sessions = tmp_path / "sessions"
    sessions.mkdir()
    good, bad = sessions / "a.jsonl", sessions / "b.jsonl"
    assert cli_main(["generate", "--model", str(MODEL), "--prompt", "Hi", "-n", "3", "--log", str(good)]) == 0
    records = [json.loads(line) for line in good.read_text().splitlines()]
    token = next(r for r in records if r["type"] == "token")
    token["layers"][0]["chosen"][0] = 10**30  # no expert id: overflows any integer array
    bad.write_text("".join(json.dumps(r) + "\n" for r in records))
    app = make_app(tmp_path)
    async with app.run_test(size=(160, 48)) as pilot:
        await wait_for(pilot, lambda: app.engine is not None)
        await pilot.press("f3")
        await pilot.pause()
        screen = app.screen
        assert isinstance(screen, SessionsScreen)
        screen.pick("a", good)
        screen.pick("b", bad)
        await wait_for(pilot, lambda: errors(app), timeout=10)
        line = errors(app)[-1]
        assert "\n" not in line and "internal error" not in line and str(bad) in line, line
        assert app.is_running and isinstance(app.screen, SessionsScreen)


async def test_sigterm_closes_the_engine_and_writes_the_heat_counts(tmp_path):
    heat = tmp_path / "run.heat"
    app = make_app(tmp_path, heat=heat)
    async with app.run_test(size=(160, 48)) as pilot:
        await wait_for(pilot, lambda: app.engine is not None)
        engine = app.engine
        prompt = app.query_one("#prompt", Input)
        prompt.focus()
        prompt.value = "Hello"
        await pilot.press("enter")
        await wait_for(pilot, lambda: app.replies > 0)
        routed = np.array(engine.heat, dtype=np.int64, copy=True)
        assert routed.sum() > 0
        # the app's handler is in place (else the signal would end the test run itself)
        assert signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, None)
        os.kill(os.getpid(), signal.SIGTERM)
        await wait_for(pilot, lambda: not app.is_running, timeout=30)
    assert app.return_code == 143
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    np.testing.assert_array_equal(HeatProfile.read(heat, 8, 32).counts, routed)
