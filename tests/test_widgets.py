"""The app's widgets on their own: knobs by keys and mouse, the heatmap from plain arrays, meters."""

from __future__ import annotations

import numpy as np
import pytest
from textual.app import App, ComposeResult

from tierlab.widgets.heatmap import (
    CHOSEN_COLORS,
    CURSOR_COLOR,
    GUTTER,
    LEVEL_COLORS,
    SWAPPED_COLOR,
    ExpertHeatmap,
    HeatmapData,
    cell_colors,
)
from tierlab.widgets.knob import NAME_WIDTH, Knob, KnobSelect, KnobSwitch
from tierlab.widgets.meters import MeterHistory, MeterPlot, MeterRow, MetersPanel


class KnobApp(App):
    def __init__(self) -> None:
        super().__init__()
        self.changes: list[tuple[str, object]] = []

    def compose(self) -> ComposeResult:
        yield Knob("ROUTE_P", 0.0, 1.0, value=0.0, default=0.0, id="p")
        yield Knob("ROUTE_J", 0, 8, value=2, default=2, integer=True, id="j")
        yield KnobSwitch("CACHE_ROUTE", False, id="cr")
        yield KnobSelect("ROUTE_MODE", ["maxrank", "cumprob", "prior"], "maxrank", id="mode")

    def on_knob_changed(self, event: Knob.Changed) -> None:
        self.changes.append((event.knob_name, event.value))

    def on_knob_switch_changed(self, event: KnobSwitch.Changed) -> None:
        self.changes.append((event.knob_name, event.value))

    def on_knob_select_changed(self, event: KnobSelect.Changed) -> None:
        self.changes.append((event.knob_name, event.value))


async def test_knob_keys_step_page_and_ends():
    app = KnobApp()
    async with app.run_test(size=(60, 10)) as pilot:
        knob = app.query_one("#j", Knob)
        knob.focus()
        await pilot.press("right", "right")
        assert knob.value == 4
        await pilot.press("left")
        assert knob.value == 3
        await pilot.press("end")
        assert knob.value == 8
        await pilot.press("right")  # stays at the top
        assert knob.value == 8
        await pilot.press("home")
        assert knob.value == 0
        await pilot.press("pageup")
        assert knob.value == 1  # big step of an 0..8 int knob is one tenth, at least one step
        await pilot.press("delete")
        assert knob.value == 2
        await pilot.pause()
        assert [v for n, v in app.changes if n == "ROUTE_J"] == [3, 4, 3, 8, 0, 1, 2]
        assert all(isinstance(v, int) for n, v in app.changes if n == "ROUTE_J")


async def test_float_knob_steps_in_hundredths_and_pages_in_tenths():
    app = KnobApp()
    async with app.run_test(size=(60, 10)) as pilot:
        knob = app.query_one("#p", Knob)
        knob.focus()
        await pilot.press("right")
        assert knob.value == pytest.approx(0.01)
        await pilot.press("pageup", "pageup")
        assert knob.value == pytest.approx(0.21)
        await pilot.press("pagedown")
        assert knob.value == pytest.approx(0.11)


async def test_knob_click_and_drag_set_by_position():
    app = KnobApp()
    async with app.run_test(size=(60, 10)) as pilot:
        knob = app.query_one("#p", Knob)
        layout = knob._layout()
        await pilot.click("#p", offset=(layout.bar_x, 0))
        assert knob.value == 0.0
        await pilot.click("#p", offset=(layout.bar_x + layout.bar_width - 1, 0))
        assert knob.value == 1.0
        await pilot.click("#p", offset=(layout.bar_x + (layout.bar_width - 1) // 2, 0))
        assert 0.4 <= knob.value <= 0.6
        assert knob.has_focus
        # drag: press at the left end, move to the right end, release
        await pilot.mouse_down("#p", offset=(layout.bar_x, 0))
        assert knob.value == 0.0
        await pilot.hover("#p", offset=(layout.bar_x + layout.bar_width + 5, 0))
        assert knob.value == 1.0
        await pilot.mouse_up("#p", offset=(layout.bar_x + layout.bar_width + 5, 0))
        # clicking on the name does nothing
        await pilot.click("#p", offset=(1, 0))
        assert knob.value == 1.0


async def test_knob_shows_name_value_and_default():
    app = KnobApp()
    async with app.run_test(size=(60, 10)) as pilot:
        knob = app.query_one("#p", Knob)
        knob.value = 0.5
        await pilot.pause()
        line = knob.render().plain
        assert line.startswith("ROUTE_P")
        assert "0.50" in line and "(0.00)" in line
        assert "●" in line
        assert len(line) <= knob.size.width
        assert NAME_WIDTH < line.index("●")


async def test_quiet_update_posts_nothing():
    app = KnobApp()
    async with app.run_test(size=(60, 10)) as pilot:
        app.query_one("#j", Knob).set_value_quietly(5)
        app.query_one("#cr", KnobSwitch).set_value_quietly(True)
        app.query_one("#mode", KnobSelect).set_value_quietly("prior")
        await pilot.pause()
        assert app.changes == []
        assert app.query_one("#j", Knob).value == 5
        assert app.query_one("#cr", KnobSwitch).value is True
        assert app.query_one("#mode", KnobSelect).value == "prior"


async def test_switch_and_select_post_changes():
    app = KnobApp()
    async with app.run_test(size=(60, 10)) as pilot:
        app.query_one("#cr", KnobSwitch).value = True
        app.query_one("#mode", KnobSelect).value = "prior"
        await pilot.pause()
        assert ("CACHE_ROUTE", True) in app.changes
        assert ("ROUTE_MODE", "prior") in app.changes


async def test_switch_toggles_by_click():
    app = KnobApp()
    async with app.run_test(size=(60, 10)) as pilot:
        await pilot.click("#cr Switch")
        await pilot.pause()
        assert app.query_one("#cr", KnobSwitch).value is True
        assert ("CACHE_ROUTE", True) in app.changes


# -- heatmap -------------------------------------------------------------------


def sample_data(n_layers: int = 4, n_experts: int = 8) -> HeatmapData:
    data = HeatmapData.empty(n_layers, n_experts)
    data.levels[:, :2] = 2  # experts 0,1 on the GPU tier
    data.levels[:, 2:4] = 1  # experts 2,3 in RAM
    data.heat[:] = np.arange(n_experts)[None, :]
    data.chosen[0, [1, 3]] = True
    data.chosen[1, [5, 6]] = True
    data.swapped[0, 3] = True
    data.last_use[0, 1] = 7
    data.token = 7
    return data


class HeatmapApp(App):
    def __init__(self, data: HeatmapData) -> None:
        super().__init__()
        self.data = data

    def compose(self) -> ComposeResult:
        yield ExpertHeatmap(self.data, id="hm")


def test_cell_colors_follow_residency_choice_and_swaps():
    data = sample_data()
    colors = cell_colors(data, "residency")
    assert colors[2, 0] == LEVEL_COLORS[2]
    assert colors[2, 2] == LEVEL_COLORS[1]
    assert colors[2, 7] == LEVEL_COLORS[0]
    assert colors[0, 1] == CHOSEN_COLORS[2]  # chosen, on the GPU tier
    assert colors[0, 3] == SWAPPED_COLOR  # chosen only because resident
    assert colors[1, 5] == CHOSEN_COLORS[0]  # chosen, read from disk
    token = cell_colors(data, "token")
    assert token[2, 0] != LEVEL_COLORS[2]  # not chosen: blank in the token view
    assert token[0, 1] == CHOSEN_COLORS[2]
    heat = cell_colors(data, "heat")
    assert heat[0, 0] != heat[0, 7]
    assert len(set(cell_colors(data, "swaps")[0])) >= 2


async def test_heatmap_draws_two_layers_per_row_with_half_blocks():
    data = sample_data()
    app = HeatmapApp(data)
    async with app.run_test(size=(40, 5)) as pilot:  # too short for one layer per row
        heatmap = app.query_one(ExpertHeatmap)
        app.set_focus(None)
        await pilot.pause()
        text = heatmap.render()
        lines = text.plain.split("\n")
        assert lines[0].startswith("exp")
        assert lines[1].startswith("  0 ") and lines[2].startswith("  2 ")
        assert lines[1][GUTTER:] == "▀" * 8 * heatmap.cell_width
        # the styles of row 0 carry layer 0 as foreground and layer 1 as background
        spans = [s for s in text.spans if s.start >= len(lines[0]) + 1 + GUTTER][:8]
        first = spans[0].style
        assert str(first.color.name if first.color.triplet is None else first.color.triplet.hex) == LEVEL_COLORS[2]
        assert first.bgcolor.triplet.hex == LEVEL_COLORS[2]
        cell_3 = spans[3].style
        assert cell_3.color.triplet.hex == SWAPPED_COLOR
        assert "residency" in lines[-2]
        assert lines[-1].startswith("L0 E0")


async def test_heatmap_cursor_keys_and_info_line():
    app = HeatmapApp(sample_data())
    async with app.run_test(size=(40, 12)) as pilot:
        heatmap = app.query_one(ExpertHeatmap)
        heatmap.focus()
        await pilot.press("right", "down")
        assert heatmap.cursor == (1, 1)
        await pilot.press("up", "right", "right")
        assert heatmap.cursor == (0, 3)
        info = heatmap.info_text()
        assert "L0 E3" in info and "RAM cache" in info and "heat 3" in info and "swapped in now" in info
        await pilot.press("end")
        assert heatmap.cursor == (0, 7)
        # the cursor half of the cell is painted in the cursor colour
        text = heatmap.render()
        assert any(s.style.color is not None and s.style.color.triplet and s.style.color.triplet.hex == CURSOR_COLOR
                   for s in text.spans)
        await pilot.press("m")
        assert heatmap.mode == "heat"
        await pilot.press("m", "m", "m")
        assert heatmap.mode == "residency"


async def test_heatmap_hover_and_click_pick_cells():
    app = HeatmapApp(sample_data())
    async with app.run_test(size=(40, 5)) as pilot:  # two layers per row
        heatmap = app.query_one(ExpertHeatmap)
        cell = heatmap.cell_width
        assert cell == 4  # 8 experts in 36 columns: drawn 4 columns wide
        await pilot.hover("#hm", offset=(GUTTER + cell + 1, 1))
        assert heatmap.hover == (0, 1)
        assert "L0 E1" in heatmap.info_text() and "last use #7" in heatmap.info_text()
        assert "L1" not in heatmap.info_text().split("|")[0]
        await pilot.click("#hm", offset=(GUTTER + 5 * cell, 2))
        assert heatmap.cursor == (2, 5)


async def test_256_experts_scroll_sideways_at_100_columns():
    data = HeatmapData.empty(40, 256)
    data.levels[:, 200] = 2
    app = HeatmapApp(data)
    async with app.run_test(size=(100, 30)) as pilot:
        heatmap = app.query_one(ExpertHeatmap)
        heatmap.fold = "scroll"
        heatmap.focus()
        await pilot.pause()
        lines = heatmap.render().plain.split("\n")
        assert all(len(line) <= 100 for line in lines)
        assert "◀0–95 of 256▶" in lines[0]
        await pilot.press("end")
        assert heatmap.cursor == (0, 255)
        assert heatmap.x_offset == 256 - heatmap.grid_width
        lines = heatmap.render().plain.split("\n")
        assert f"◀{256 - heatmap.grid_width}–255 of 256▶" in lines[0]
        assert "E255" in lines[-1]
        await pilot.press("pageup")
        assert heatmap.cursor == (0, 255 - heatmap.grid_width)


async def test_256_experts_fold_into_bands():
    data = HeatmapData.empty(8, 256)
    app = HeatmapApp(data)
    async with app.run_test(size=(100, 30)) as pilot:
        heatmap = app.query_one(ExpertHeatmap)
        await pilot.pause()
        assert heatmap.is_folded()  # 3 bands of 5 lines fit in 28 lines: folded automatically
        lines = heatmap.render().plain.split("\n")
        headers = [line for line in lines if line.startswith("exp")]
        assert len(headers) == 3
        # every expert appears exactly once per row (3 bands of 8 layers fit: one layer per row)
        cells = sum(line.count("█") + line.count("▀") for line in lines if line[:3].strip().isdigit() and line[3] == " " and line.startswith("  0"))
        assert cells == 256
        heatmap.focus()
        await pilot.press("end")
        assert heatmap.cursor == (0, 255)


async def test_256_experts_40_layers_fold_scrolls_vertically():
    data = HeatmapData.empty(40, 256)
    app = HeatmapApp(data)
    async with app.run_test(size=(100, 30)) as pilot:
        heatmap = app.query_one(ExpertHeatmap)
        heatmap.fold = "fold"
        heatmap.focus()
        await pilot.press("end", "down", "down")
        assert heatmap.cursor == (2, 255)
        assert heatmap.y_offset > 0
        lines = heatmap.render().plain.split("\n")
        assert len(lines) == 30 - 0
        assert "L2 E255" in lines[-1]


async def test_heatmap_redraws_are_throttled():
    app = HeatmapApp(sample_data())
    async with app.run_test(size=(40, 12)) as pilot:
        heatmap = app.query_one(ExpertHeatmap)
        await pilot.pause(0.15)
        before = heatmap.redraw_count
        for token in range(200):
            data = sample_data()
            data.token = token
            heatmap.update_data(data)
        await pilot.pause(0.35)
        assert heatmap.redraw_count - before <= 6


# -- meters --------------------------------------------------------------------


class MetersApp(App):
    def compose(self) -> ComposeResult:
        yield MetersPanel()
        yield MeterPlot()


async def test_meters_show_values_sparklines_and_plot_marks():
    app = MetersApp()
    history = MeterHistory()
    for token in range(30):
        history.add(token, {"ram_hit": token / 30, "vram_hit": 0.0, "oracle_hit": 0.9, "swap": 0.1,
                            "swaps_to_vram": 3, "route_agree": 0.894, "route_kl": 1.85, "tok_s": 12.5, "fetch_ms": 3.25, "compute_ms": 40.0})
    history.mark(10, "ROUTE_J=1")
    async with app.run_test(size=(80, 30)) as pilot:
        app.query_one(MetersPanel).show(history)
        app.query_one(MeterPlot).show(history)
        await pilot.pause()
        row = app.query_one("#meter-route_agree", MeterRow)
        assert "89.4%" in str(row.query_one(".meter--value").render())
        swap = app.query_one("#meter-swap", MeterRow)
        assert "3→V" in str(swap.query_one(".meter--value").render())
        from textual.widgets import Sparkline

        assert len(app.query_one("#meter-ram_hit Sparkline", Sparkline).data) == 30
        plot_text = app.query_one(MeterPlot).render().plain
        assert "hit rate" in plot_text
        assert "ROUTE_J=1" in plot_text  # the knob change is marked where it happened
        assert history.marks[0].token == 10


async def test_heatmap_lines_never_wrap_in_a_narrow_pane():
    data = sample_data(6, 16)
    app = HeatmapApp(data)
    async with app.run_test(size=(30, 12)) as pilot:
        heatmap = app.query_one(ExpertHeatmap)
        heatmap.hover = (0, 3)
        await pilot.pause()
        lines = heatmap.render().plain.split("\n")
        assert len(lines) == 12
        assert all(len(line) <= 30 for line in lines)
        assert lines[-1].startswith("L0 E3") and lines[-1].endswith("…")


async def test_heatmap_shows_per_layer_hit_rates_when_there_is_room():
    data = sample_data(4, 8)
    data.layer_hit = np.array([88.0, 41.0, np.nan, 100.0])
    app = HeatmapApp(data)
    async with app.run_test(size=(60, 5)) as pilot:  # two layers per row
        heatmap = app.query_one(ExpertHeatmap)
        assert heatmap.shows_side
        lines = heatmap.render().plain.split("\n")
        assert "RAM hit" in lines[0]
        assert lines[1].rstrip().endswith("88%  41%")
        assert lines[2].rstrip().endswith("– 100%")
        assert all(len(line) <= 60 for line in lines)
        # hover still finds the right expert with the narrower cells
        await pilot.hover("#hm", offset=(GUTTER + 3 * heatmap.cell_width, 1))
        assert heatmap.hover == (0, 3)
    wide = HeatmapData.empty(4, 256)
    wide.layer_hit = np.zeros(4)
    app = HeatmapApp(wide)
    async with app.run_test(size=(100, 12)) as pilot:
        assert not app.query_one(ExpertHeatmap).shows_side  # experts first: no room, no column


async def test_integer_big_step_is_a_tenth_of_the_range_and_follows_it():
    app = KnobApp()
    async with app.run_test(size=(60, 10)) as pilot:
        knob = app.query_one("#j", Knob)
        knob.set_range(0, 256, default=12)
        knob.focus()
        await pilot.press("home", "pageup")
        assert knob.value == 26
        await pilot.press("delete")
        assert knob.value == 12


async def test_percentage_sparklines_use_a_fixed_scale():
    from tierlab.widgets.meters import ScaledSparkline, bar_levels

    assert bar_levels([100.0] * 5, 10, 100.0) == [1.0] * 5  # a steady 100% is a full bar
    assert bar_levels([50.0, 50.0], 10, 100.0) == [0.5, 0.5]  # not stretched to the range shown
    assert bar_levels([1.0, 3.0, 2.0, 4.0], 2, None) == [0.75, 1.0]  # other units: 0 to the largest
    app = MetersApp()
    history = MeterHistory()
    for token in range(20):
        history.add(token, {"ram_hit": 0.5, "route_agree": 1.0, "tok_s": 10.0})
    async with app.run_test(size=(80, 30)) as pilot:
        app.query_one(MetersPanel).show(history)
        await pilot.pause()
        agree = app.query_one("#meter-route_agree ScaledSparkline", ScaledSparkline).render().plain
        hit = app.query_one("#meter-ram_hit ScaledSparkline", ScaledSparkline).render().plain
        assert agree and set(agree) == {"█"}
        assert set(hit) == {"▅"}  # half the scale
        row = app.query_one("#meter-vram_hit", MeterRow)
        assert str(row.query_one(".meter--value").render()).strip() == "–"  # no samples: "–", never 0.0%
