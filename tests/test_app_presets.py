"""Knob presets in the real app, on the shipped model: shipped ones, save and load, bad files."""

from __future__ import annotations

import pytest
from textual.widgets import Input, OptionList, Switch

from tierlab.app.tui.knob_panel import knob_id
from tierlab.app.tui.preset_screen import PresetScreen
from tierlab.app.tui.presets import (PresetError, find_preset, list_presets, parse_preset, preset_folder,
                                     read_preset, write_preset)
from tierlab.engine.knobs import KnobValues
from tierlab.widgets.knob import Knob

from test_app import ready
from test_app_drilldown import shipped_app

SHIPPED_KNOBS = {
    "stock": KnobValues(),
    "recommended": KnobValues(CACHE_ROUTE=True, ROUTE_J=2, ROUTE_M=12),
    "aggressive": KnobValues(CACHE_ROUTE=True, ROUTE_J=1, ROUTE_M=16),
}


def test_preset_files_round_trip_and_bad_ones_name_the_file(tmp_path):
    values = KnobValues(CACHE_ROUTE=True, ROUTE_MODE="cumprob", ROUTE_P=0.75, PILOT=2, ROUTE_AGREE="1")
    path = write_preset(tmp_path, "mine", values)
    assert path == tmp_path / "mine.preset"
    assert read_preset(path).values == values
    assert "ROUTE_J" not in path.read_text()  # defaults are left out: they load as defaults
    assert not list(tmp_path.glob(".*tmp"))  # written atomically, nothing left behind
    for text, problem in [("ROUTE_J=two\n", "ROUTE_J"), ("NOPE=1\n", "unknown knob"), ("CACHE_ROUTE\n", "KNOB=VALUE"),
                          ("ROUTE_J=1\nROUTE_J=2\n", "twice"), ("ROUTE_MODE=fast\n", "ROUTE_MODE")]:
        bad = tmp_path / "bad.preset"
        bad.write_text(text)
        with pytest.raises(PresetError, match=problem) as caught:
            read_preset(bad)
        assert str(bad) in str(caught.value) and "\n" not in str(caught.value)
    (tmp_path / "bad.preset").write_bytes(b"\xff\xfe")
    with pytest.raises(PresetError, match="UTF-8"):
        read_preset(tmp_path / "bad.preset")
    with pytest.raises(PresetError, match="preset name"):
        write_preset(tmp_path, "../escape", values)
    presets, problems = list_presets(tmp_path)
    assert {p.name for p in presets} == {"mine", *SHIPPED_KNOBS}
    assert len(problems) == 1 and "bad.preset" in problems[0]
    for name, expected in SHIPPED_KNOBS.items():
        assert find_preset(tmp_path, name).values == expected
    assert parse_preset("# header\n# what it is for\nHOT=3\n", "x")[1] == "what it is for"


def panel_values(app) -> dict:
    return {
        "CACHE_ROUTE": app.query_one(f"#{knob_id('CACHE_ROUTE')} Switch", Switch).value,
        "ROUTE_J": app.query_one(f"#{knob_id('ROUTE_J')}", Knob).value,
        "ROUTE_M": app.query_one(f"#{knob_id('ROUTE_M')}", Knob).value,
    }


async def test_shipped_presets_set_the_engine_knobs_and_saved_ones_load_back(tmp_path):
    app = shipped_app(tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        await ready(pilot)
        knobs = app.engine.knobs
        folder = preset_folder(app.sessions_dir)
        # the three shipped presets, each from the palette's command, read back from the engine
        commands = {c.title: c for c in app.get_system_commands(app.screen)}
        for name, expected in SHIPPED_KNOBS.items():
            commands[f"Preset: {name}"].callback()
            await pilot.pause()
            assert knobs.snapshot() == expected, name
            assert panel_values(app) == {"CACHE_ROUTE": expected.CACHE_ROUTE, "ROUTE_J": expected.ROUTE_J,
                                         "ROUTE_M": expected.ROUTE_M}
        assert {p.name for p in list_presets(folder)[0]} == set(SHIPPED_KNOBS)
        # the picker (ctrl+g): save the current knobs under a name, then load a shipped one with Enter
        knobs.set("PILOT", 2)
        knobs.set("ROUTE_M", 20)
        saved = knobs.snapshot()
        await pilot.press("ctrl+g")
        await pilot.pause()
        assert isinstance(app.screen, PresetScreen)
        name_field = app.screen.query_one("#preset-name", Input)
        name_field.focus()
        name_field.value = "wide-pilot"
        await pilot.press("enter")
        await pilot.pause()
        assert (folder / "wide-pilot.preset").is_file()
        options = app.screen.query_one("#preset-list", OptionList)
        ids = [options.get_option_at_index(i).id for i in range(options.option_count)]
        assert ids == sorted(["wide-pilot", *SHIPPED_KNOBS])
        options.focus()
        options.highlighted = ids.index("stock")
        await pilot.press("enter")
        await pilot.pause()
        assert not isinstance(app.screen, PresetScreen)
        assert knobs.snapshot() == KnobValues()
        assert app.load_preset("wide-pilot")
        assert knobs.snapshot() == saved
        # a bad file is a notification, and the knobs stay as they are
        (folder / "broken.preset").write_text("ROUTE_J=-3\n")
        assert not app.load_preset("broken")
        assert knobs.snapshot() == saved
        assert any("broken.preset" in text and "ROUTE_J" in text and severity == "error"
                   for text, severity in app.notes)
        await pilot.press("ctrl+g")
        await pilot.pause()
        assert isinstance(app.screen, PresetScreen)
        assert any("broken.preset" in text and severity == "warning" for text, severity in app.notes)
        await pilot.press("escape")
        await pilot.pause()
        assert not isinstance(app.screen, PresetScreen)
        assert app.is_running
