"""The heatmap at real scale (40 layers x 256 experts): every layer reachable, the position said,
one row per layer when tall enough, the ruler when there is room, a resize starting afresh."""

from __future__ import annotations

import numpy as np
from textual.app import App, ComposeResult

import tierlab
from test_app import make_app, ready, tiny_model  # noqa: F401  (fixtures)
from tierlab.widgets.heatmap import GUTTER, ExpertHeatmap, HeatmapData


def real_scale(n_layers: int = 40, n_experts: int = 256) -> HeatmapData:
    data = HeatmapData.empty(n_layers, n_experts)
    data.heat[:] = np.arange(n_experts)[None, :] + np.arange(n_layers)[:, None]
    data.levels[:, ::7] = 1
    return data


class HeatmapApp(App):
    def __init__(self, data: HeatmapData) -> None:
        super().__init__()
        self.data = data

    def compose(self) -> ComposeResult:
        yield ExpertHeatmap(self.data, id="hm")


def row_layers(heatmap: ExpertHeatmap) -> list[int]:
    """The layer numbers in the gutter of the lines drawn now."""
    lines = heatmap.render().plain.split("\n")[: heatmap.grid_height]
    return [int(line[:GUTTER]) for line in lines if line[:GUTTER].strip().isdigit()]


def drawn_layers(heatmap: ExpertHeatmap) -> set[int]:
    """Every layer drawn now, the lower halves of shared rows included."""
    layers = set()
    for line in heatmap.grid_lines()[heatmap.y_offset: heatmap.y_offset + heatmap.grid_height]:
        if line.kind == "row":
            layers.add(line.top)
            if line.bottom >= 0:
                layers.add(line.bottom)
    return layers


async def test_every_layer_of_40_is_reachable_and_the_border_says_which_are_shown():
    for fold in ("auto", "fold", "scroll"):
        app = HeatmapApp(real_scale())
        async with app.run_test(size=(110, 20)) as pilot:
            heatmap = app.query_one(ExpertHeatmap)
            heatmap.fold = fold
            heatmap.focus()
            await pilot.pause()
            seen = drawn_layers(heatmap)
            assert seen != set(range(40))  # 20 lines cannot hold them all
            assert "▼" in heatmap.position_text() and "▲" not in heatmap.position_text()
            assert heatmap.position_text().endswith(f"of 40 ▼"), heatmap.position_text()
            for _ in range(40):
                await pilot.press("down")
                seen |= drawn_layers(heatmap)
            assert heatmap.cursor[0] == 39
            assert seen == set(range(40)), fold
            position = heatmap.position_text()
            assert "▲" in position and "39" in position
            assert str(heatmap.border_subtitle) == position
            if heatmap.is_folded():
                assert position.startswith("band ") and "/3" in position


async def test_the_mouse_wheel_reaches_the_last_layer():
    app = HeatmapApp(real_scale())
    async with app.run_test(size=(110, 20)) as pilot:
        heatmap = app.query_one(ExpertHeatmap)
        heatmap.fold = "scroll"
        await pilot.pause()
        for _ in range(60):
            heatmap._scroll_lines(1)
        assert 39 in drawn_layers(heatmap)
        assert heatmap.position_text().startswith("layers ") and heatmap.position_text().endswith("39 of 40 ▲")


async def test_one_row_per_layer_when_the_pane_is_tall_enough():
    app = HeatmapApp(real_scale(8, 32))
    async with app.run_test(size=(60, 12)) as pilot:
        heatmap = app.query_one(ExpertHeatmap)
        await pilot.pause()
        assert row_layers(heatmap) == list(range(8))
        lines = heatmap.render().plain.split("\n")
        assert lines[0].startswith("exp")  # room for the ruler too
        assert set(lines[1][GUTTER:].strip()) == {"█"}
        assert heatmap.position_text() == ""
        await pilot.resize_terminal(60, 6)
        await pilot.pause()
        assert row_layers(heatmap) == [0, 2, 4, 6]  # shorter: two layers per row, every layer still drawn
        assert drawn_layers(heatmap) == set(range(8))


async def test_a_resize_resets_scrolling_and_brings_the_ruler_back():
    app = HeatmapApp(real_scale())
    async with app.run_test(size=(80, 12)) as pilot:
        heatmap = app.query_one(ExpertHeatmap)
        heatmap.fold = "scroll"
        heatmap.focus()
        await pilot.pause()
        for _ in range(39):
            await pilot.press("down")
        assert heatmap.y_offset > 0
        heatmap.cursor = (0, 0)
        await pilot.resize_terminal(220, 60)
        await pilot.pause()
        assert heatmap.y_offset == 0 and heatmap.x_offset == 0
        lines = heatmap.render().plain.split("\n")
        assert lines[0].startswith("exp")  # the expert ruler, now that there is room
        assert drawn_layers(heatmap) == set(range(40))
        assert heatmap.position_text() == ""


async def test_hovering_a_shared_row_names_both_layers():
    app = HeatmapApp(real_scale(8, 16))
    async with app.run_test(size=(60, 6)) as pilot:  # two layers per row
        heatmap = app.query_one(ExpertHeatmap)
        await pilot.pause()
        line = heatmap.grid_lines()[heatmap.y_offset + 1]
        assert (line.top, line.bottom) == (2, 3)
        await pilot.hover("#hm", offset=(GUTTER + 5 * heatmap.cell_width, 1))
        info = heatmap.info_text()
        upper, lower = info.split("|")
        assert upper.strip().startswith("L2 E5") and lower.strip().startswith("L3 E5")


async def test_every_layer_of_the_shipped_model_is_drawn_at_80x24(make_app):
    app = make_app(model_dir=tierlab.ASSETS_DIR / "tiny-moe", cache_slots=12)
    async with app.run_test(size=(80, 24)) as pilot:
        await ready(pilot)
        await pilot.pause()
        heatmap = app.query_one(ExpertHeatmap)
        assert drawn_layers(heatmap) == set(range(8))  # layers 6 and 7 too
        assert heatmap.position_text() == ""
        await pilot.resize_terminal(220, 60)
        await pilot.pause()
        assert heatmap.render().plain.startswith("exp")  # the ruler, and one row per layer
        assert row_layers(heatmap) == list(range(8))


async def test_a_40x256_model_in_the_app_says_which_layers_are_in_view(make_app, model_40x256):
    app = make_app(model_dir=model_40x256, cache_slots=96)
    async with app.run_test(size=(160, 48)) as pilot:
        await ready(pilot)
        await pilot.pause(0.2)
        heatmap = app.query_one(ExpertHeatmap)
        assert str(heatmap.border_subtitle).startswith("layers 0–") and "of 40 ▼" in str(heatmap.border_subtitle)
        heatmap.focus()
        for _ in range(39):
            await pilot.press("down")
        await pilot.pause(0.2)
        assert 39 in drawn_layers(heatmap) and "▲" in str(heatmap.border_subtitle)
        heatmap.hover = None
        assert heatmap.info_text().startswith("L39 E0")
