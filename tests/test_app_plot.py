"""The meters plot as text: knob-change labels never print over each other or the legend."""

from __future__ import annotations

from textual.app import App, ComposeResult

from tierlab.widgets.meters import MeterHistory, MeterPlot, place_labels, KnobMark


class PlotApp(App):
    def compose(self) -> ComposeResult:
        yield MeterPlot()


def crowded_history() -> MeterHistory:
    history = MeterHistory()
    for token in range(40):
        history.add(token, {"ram_hit": 0.5 + token / 100, "vram_hit": None, "tok_s": 12.0 + token % 5})
    for token, label in ((2, "cache=8"), (20, "CACHE_ROUTE=1"), (21, "cache=32"), (23, "ROUTE_LAMBDA=0.2")):
        history.mark(token, label)
    return history


async def test_close_knob_changes_keep_their_labels_whole():
    for size in ((70, 16), (100, 24), (60, 10)):
        app = PlotApp()
        async with app.run_test(size=size) as pilot:
            plot = app.query_one(MeterPlot)
            plot.show(crowded_history())
            await pilot.pause()
            text = plot.render().plain
            assert "left: RAM hit rate % · right: tok/s · │ knob change" in text, size
            for label in ("cache=8", "CACHE_ROUTE=1", "cache=32", "ROUTE_LAMBDA=0.2"):
                assert label in text, (size, label, text)
            assert "cachc" not in text and "CAcac" not in text


def test_label_placement_never_overlaps_and_stays_on_the_canvas():
    marks = [KnobMark(t, f"K{t}=value") for t in (0, 1, 2, 3, 30, 36, 39)]
    placed = place_labels(marks, 0, 39, 40, levels=3)
    spans: dict[int, list[tuple[int, int]]] = {}
    for label in placed:
        start = round(label.token * 39 / 39)
        spans.setdefault(label.level, []).append((start, start + len(label.text)))
        assert start + len(label.text) <= 40
    for level_spans in spans.values():
        level_spans.sort()
        assert all(a[1] < b[0] for a, b in zip(level_spans, level_spans[1:]))
    # a fourth label at the start fits on no row; one on the last column has no room at all
    assert {label.token for label in placed} == {0, 1, 2, 30, 36}
    assert [(label.level, label.text) for label in placed if label.token == 36] == [(1, "K36…")]


def test_a_meter_without_samples_draws_no_line():
    history = MeterHistory()
    for token in range(10):
        history.add(token, {"ram_hit": None if token < 4 else 0.5, "vram_hit": None, "tok_s": 10.0})
    assert history.points("ram_hit") == (list(range(4, 10)), [50.0] * 6)
    assert history.points("vram_hit") == ([], [])
    assert history.values("ram_hit")[:4] == [0.0] * 4  # the sparkline's floor, not a plotted value
