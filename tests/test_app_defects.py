"""The app defects a new user meets (issue list): keys, the heat inspector, sessions, labels."""

from __future__ import annotations

import time

import numpy as np
from textual.widgets import DataTable, Input

from test_app import ask, build_tiny_model, make_app, ready, tiny_model, wait_for  # noqa: F401  (fixtures)
from tierlab.app.tui.chat import NO_TOKENIZER_HINT, ChatPane, looks_like_code
from tierlab.app.tui.heat_screen import HeatInspector, ProfilePane
from tierlab.app.tui.help_screen import HelpScreen
from tierlab.app.tui.keys import key_label
from tierlab.app.tui.knob_panel import knob_id
from tierlab.app.tui.sessions_screen import SessionsScreen
from tierlab.engine.heat import HeatProfile
from tierlab.widgets.heatmap import CPU_TIER, DIFF_MODE, GPU_TIER, ExpertHeatmap, tier_names
from tierlab.widgets.knob import KnobSwitch
from tierlab.widgets.meters import MeterRow


# -- keys ----------------------------------------------------------------------


async def test_question_mark_and_q_act_on_an_empty_prompt_and_type_otherwise(make_app):
    app = make_app()
    async with app.run_test(size=(100, 30)) as pilot:
        prompt = app.query_one("#prompt", Input)
        assert app.focused is prompt
        await pilot.press("question_mark")
        await pilot.pause()
        assert isinstance(app.screen, HelpScreen)
        await pilot.press("escape")
        await pilot.pause()
        await pilot.press("w", "h", "y", "question_mark", "q")
        assert prompt.value == "why?q" and not isinstance(app.screen, HelpScreen)
        prompt.value = ""
        await pilot.press("q")
        await pilot.pause()
        await wait_for(pilot, lambda: app.return_code is not None, timeout=10)


def test_one_key_style():
    assert [key_label(k) for k in ("f2", "ctrl+r", "escape", "left", "pagedown", "q", "question_mark")] == [
        "F2", "^R", "Esc", "←", "PgDn", "q", "?"]


async def test_footer_help_and_palette_write_keys_one_way(make_app):
    app = make_app()
    async with app.run_test(size=(160, 30)) as pilot:
        await wait_for(pilot, lambda: len(app.query("FooterKey")) > 3, timeout=10)
        footer_keys = [str(key.key_display) for key in app.query("FooterKey")]
        assert footer_keys and all(k in ("^Q", "F1", "Esc", "^R", "F2", "F3", "F5", "^L", "^P") for k in footer_keys), footer_keys
        commands = {c.title: c.help for c in app.get_system_commands(app.screen)}
        assert commands["Help: keys and panes"].endswith("key F1 / ?")
        assert commands["Heat profile inspector"].endswith("key F2")
        assert commands["Toggle recording"].endswith("key ^R / r")
        assert commands["Quit"].endswith("key ^Q / q")
        await pilot.press("f1")
        await pilot.pause()
        rows = app.screen.rows()
        knob_rows = {row[1]: row[0] for row in rows if row[2] == "knob"}
        assert knob_rows["Step down"] == "←" and knob_rows["Step up"] == "→"
        meters = dict(app.screen.meters())
        assert "RAM hit" in meters and "shadow" in meters and "N→V" in meters
        assert "GPU tier" in meters["N→V"]


# -- heat inspector ---------------------------------------------------------------


async def test_the_heat_inspector_keeps_its_profiles_shows_b_columns_and_a_minus_b(make_app, tmp_path):
    a, b = tmp_path / "a.heat", tmp_path / "b.heat"
    counts = np.arange(6 * 16, dtype=np.int64).reshape(6, 16)
    HeatProfile(6, 16, counts).write(a)
    HeatProfile(6, 16, counts[:, ::-1].copy()).write(b)
    app = make_app()
    async with app.run_test(size=(160, 48)) as pilot:
        await ready(pilot)
        await pilot.press("f2")
        await pilot.pause()
        screen = app.screen
        screen.query_one("#heat-path-a", Input).value = str(a)
        screen.query_one("#heat-path-b", Input).value = str(b)
        await pilot.click("#heat-load")
        await pilot.pause()
        table = screen.query_one("#stats-b", DataTable)
        titles = [str(c.label) for c in table.columns.values()]
        assert titles[:4] == ["layer", "top overlap", "TVD", "JS"]
        region = table.region
        assert region.right <= 160
        assert "TVD" in " ".join(str(c.label) for c in table.columns.values())
        # the TVD column is drawn inside the pane at 160 columns
        offset = sum(c.get_render_width(table) for c in list(table.columns.values())[:3])
        assert offset < table.size.width
        await pilot.press("ctrl+d")
        await pilot.pause()
        heatmap_b = screen.query_one("#heat-map-b", ExpertHeatmap)
        assert heatmap_b.mode == DIFF_MODE
        share_a = counts[0] / counts[0].sum()
        share_b = counts[0, ::-1] / counts[0].sum()
        assert heatmap_b.data.heat[0, 0] == round((share_a[0] - share_b[0]) * 10000)
        assert "A − B" in heatmap_b.describe(0, 0)
        await pilot.press("escape")
        await pilot.pause()
        await pilot.press("f2")
        await pilot.pause()
        assert isinstance(app.screen, HeatInspector) and app.screen is screen
        assert screen.query_one("#pane-a", ProfilePane).profile is not None
        assert screen.query_one("#pane-b", ProfilePane).profile is not None


# -- sessions / A-B -----------------------------------------------------------------


async def test_sessions_name_the_cache_pick_only_from_the_list_and_say_while_recording(make_app):
    app = make_app()
    async with app.run_test(size=(160, 48)) as pilot:
        await ready(pilot)
        await pilot.press("ctrl+r")
        await ask(pilot, "a", max_tokens=2)
        await pilot.press("ctrl+r")
        app.set_cache_slots(4)
        await pilot.pause()
        time.sleep(1.1)  # log names carry the second
        await pilot.press("ctrl+r")
        await ask(pilot, "a", max_tokens=2)
        await pilot.press("f3")
        await pilot.pause()
        screen = app.screen
        assert isinstance(screen, SessionsScreen)
        status = str(screen.query_one("#sessions-status").render())
        assert "recording to session-" in status and "no session logs" not in status
        table = screen.query_one("#sessions-list", DataTable)
        listed = [str(table.get_row_at(i)[2]) for i in range(table.row_count)]
        assert any(label.endswith("cache 4/16") for label in listed) and any(label.endswith("cache 6/16") for label in listed)
        await pilot.press("r")  # stop recording from the screen
        await pilot.pause()
        assert len(screen.logs) == 2
        table.move_cursor(row=1)
        await pilot.press("a")
        await pilot.press("tab")
        before = app.notes[:]
        await pilot.press("b")
        await pilot.pause()
        assert "b" not in screen.picked  # not silently the top row
        assert any("highlighted log" in text for text, _ in app.notes[len(before):])
        assert app.focused is table
        table.move_cursor(row=1)
        await pilot.press("b")
        assert "b" not in screen.picked  # a log is never both A and B
        table.move_cursor(row=0)
        await pilot.press("b")
        await pilot.pause()
        ab = screen.query_one("#ab-table", DataTable)
        rows = [[str(c) for c in ab.get_row_at(i)] for i in range(2)]
        assert rows[0][0].endswith("cache 6/16") and rows[1][0].endswith("cache 4/16")
        titles = [str(c.label) for c in ab.columns.values()]
        assert "ids match" not in titles and "TF-NLL" not in titles
        assert "need a reference run" in str(screen.query_one("#sessions-status").render())


# -- labels --------------------------------------------------------------------------


def test_the_tier_is_named_by_its_opencl_device_type():
    assert tier_names({"device": "Portable Computing Language / cpu", "capacity": 8, "cpu_device": True}) == CPU_TIER
    assert tier_names({"device": "NVIDIA / H200", "capacity": 8, "cpu_device": False}) == GPU_TIER
    assert tier_names(None) == GPU_TIER


async def test_a_pocl_tier_is_no_gpu_tier(make_app, opencl_device):
    app = make_app(tier=True)
    async with app.run_test(size=(160, 48)) as pilot:
        await ready(pilot)
        report = app.engine.tier_description()
        assert report is not None and report["cpu_device"] is True  # CI's OpenCL is PoCL on the CPU
        heatmap = app.query_one(ExpertHeatmap)
        assert heatmap.tier == CPU_TIER
        label = app.query_one("#meter-vram_hit", MeterRow).query_one(".meter--label").render()
        assert str(label) == "tier hit"
        assert "OpenCL CPU tier" in app.sub_title and "GPU" not in app.sub_title
        layer, expert = map(int, np.argwhere(heatmap.data.levels == 2)[0])
        assert "OpenCL CPU tier" in heatmap.describe(layer, expert)
        await ask(pilot, "a", max_tokens=2)
        ram = str(app.query_one("#meter-ram_hit", MeterRow).query_one(".meter--value").render()).strip()
        assert ram != "0.0%"  # a figure, or "–" where the window has no RAM requests


async def test_switches_say_on_and_the_chat_title_says_the_mode(make_app):
    app = make_app()
    async with app.run_test(size=(100, 30)) as pilot:
        await ready(pilot)
        agree = app.query_one(f"#{knob_id('ROUTE_AGREE')}", KnobSwitch)
        assert "auto" in str(agree.query_one(".knob-switch--state").render())
        app.engine.knobs.set("ROUTE_AGREE", "1")
        from tierlab.app.tui.knob_panel import KnobsPanel

        app.query_one(KnobsPanel).show(app.engine.knobs.snapshot())
        await pilot.pause()
        assert str(agree.query_one(".knob-switch--state").render()).strip().startswith("on")
        chat = app.query_one(ChatPane)
        assert chat.border_title == "Chat · chat mode"
        await pilot.press("ctrl+t")
        await pilot.pause()
        assert chat.border_title == "Chat · raw mode"
        await pilot.press("ctrl+t")
        prompt = app.query_one("#prompt", Input)
        prompt.value = "def parse(path):"
        prompt.focus()
        before = len(app.notes)
        await pilot.press("enter")
        await wait_for(pilot, lambda: len(app.notes) > before, timeout=10)
        assert any("looks like code" in text for text, _ in app.notes[before:])
    assert looks_like_code("import os\nprint(os.getcwd())") and not looks_like_code("Why is the sky blue?")


async def test_a_model_without_a_tokenizer_says_so_in_the_prompt(make_app, tmp_path):
    model = build_tiny_model(tmp_path / "no-tokenizer")
    (model / "tokenizer.json").unlink()
    app = make_app(model_dir=model)
    async with app.run_test(size=(100, 30)) as pilot:
        await ready(pilot)
        prompt = app.query_one("#prompt", Input)
        assert prompt.placeholder == NO_TOKENIZER_HINT and prompt.disabled
        assert app.query_one(ChatPane).border_title == "Chat · no tokenizer"
