"""Exports from the real app, on the shipped model: each file lands in the sessions folder and reads back."""

from __future__ import annotations

import csv
import xml.etree.ElementTree as ET

import pytest

from tierlab import ASSETS_DIR
from tierlab.app.tui.exports import CSV_LEAD
from tierlab.app.tui.sessions_screen import SessionsScreen
from tierlab.engine.meters import CATALOGUE, meters_json

from conftest import run_cli
from test_app import ask, ready, wait_for
from test_app_drilldown import shipped_app


@pytest.fixture
def home_without_downloads(tmp_path, monkeypatch):
    """A HOME with no Downloads folder, as on a server."""
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("XDG_DOWNLOAD_DIR", raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(home / ".config"))
    return home


async def test_screenshot_goes_to_the_sessions_folder_without_downloads(tmp_path, home_without_downloads):
    app = shipped_app(tmp_path)
    sessions = app.sessions_dir
    async with app.run_test(size=(100, 30)) as pilot:
        await ready(pilot)
        commands = {c.title: c for c in app.get_system_commands(app.screen)}
        commands["Screenshot"].callback()  # Textual's own palette command
        await wait_for(pilot, lambda: len(list(sessions.glob("*.svg"))) == 1, timeout=20)
        await pilot.press("ctrl+s")
        await wait_for(pilot, lambda: len(list(sessions.glob("*.svg"))) == 2, timeout=20)
        await pilot.pause(0.2)
    for svg in sessions.glob("*.svg"):
        root = ET.parse(svg).getroot()
        assert root.tag.endswith("svg")
        assert "tierlab" in svg.read_text()
    assert not (home_without_downloads / "Downloads").exists()
    assert not any("Failed" in text for text, _ in app.notes), app.notes
    assert sum("Saved screenshot" in text for text, _ in app.notes) == 2


async def test_meters_csv_heat_profile_and_reply_copy(tmp_path):
    app = shipped_app(tmp_path)
    async with app.run_test(size=(100, 30)) as pilot:
        await ready(pilot)
        reply = await ask(pilot, "Once upon a time", max_tokens=6)
        app.engine.knobs.set("CACHE_ROUTE", True)
        await ask(pilot, "The end", max_tokens=4)
        commands = {c.title: c for c in app.get_system_commands(app.screen)}
        # meters as CSV: the catalogue's keys as the header, one row per setting and per window
        commands["Export meters as CSV"].callback()
        await pilot.pause()
        csv_files = list(app.sessions_dir.glob("meters-*.csv"))
        assert len(csv_files) == 1
        rows = list(csv.DictReader(csv_files[0].open()))
        header = next(csv.reader(csv_files[0].open()))
        assert header == [*CSV_LEAD, *(m.key for m in CATALOGUE)]
        labels = [row["row"] for row in rows]
        assert labels == ["setting 1", "setting 2", "last 32 tok", "since knob change", "since start"]
        assert rows[0]["knobs"] == "lever off" and rows[1]["knobs"] == "CACHE_ROUTE=1"
        total = meters_json(app.watch.windows.summary("total", app.engine.knobs.snapshot()))
        assert float(rows[-1]["ram_hit"]) == pytest.approx(total["ram_hit"])
        assert int(rows[-1]["end_token"]) == app.watch.tokens_seen
        assert rows[0]["swap"] == "" and rows[1]["swap"] != ""  # no lever, no swap meter
        assert int(rows[0]["end_token"]) == int(rows[1]["first_token"])
        # the heatmap's counts as a heat profile that `tierlab heat show` reads
        commands["Save session heat"].callback()
        await pilot.pause()
        heat_files = list(app.sessions_dir.glob("heat-*.heat"))
        assert len(heat_files) == 1
        routings = int(app.engine.heat.sum())
        shown = run_cli("heat", "show", str(heat_files[0]), "--model", str(ASSETS_DIR / "tiny-moe"))
        assert shown.returncode == 0, shown.stderr
        assert f"8 layers x 32 experts, {routings} routings" in shown.stdout
        # the last reply to the clipboard (OSC 52), said so in a notification
        last = list(app.query("ChatMessage"))[-1]
        assert last is not reply and last.text
        await pilot.press("ctrl+y")
        await pilot.pause()
        assert app.clipboard == last.text
        assert any("OSC 52" in text for text, _ in app.notes)


async def test_ab_table_exports_as_markdown_from_the_palette(tmp_path):
    app = shipped_app(tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        await ready(pilot)
        logs = []
        for lever in (False, True):
            app.engine.knobs.set("CACHE_ROUTE", lever)
            app.action_toggle_recording()
            logs.append(app.recorder.path)
            await ask(pilot, "Once upon a time", max_tokens=4)
            app.action_toggle_recording()
            await pilot.pause()
        assert len(set(app.sessions_dir.glob("session-*.jsonl"))) == 2
        await pilot.press("f3")
        await pilot.pause()
        screen = app.screen
        assert isinstance(screen, SessionsScreen)
        screen.pick("a", logs[0])
        screen.pick("b", logs[1])
        commands = {c.title: c for c in app.get_system_commands(screen)}
        commands["Export A/B table as markdown"].callback()
        await pilot.pause()
    exported = list(app.sessions_dir.glob("ab-*.md"))
    assert len(exported) == 1
    lines = exported[0].read_text().splitlines()
    table = [line for line in lines if line.startswith("|")]
    assert len(table) == 4  # header, rule, A, B
    assert table[2].startswith("| A: lever off") and table[3].startswith("| B: CACHE_ROUTE=1")
