"""Layer drill-down and token overlay in the real app, on the shipped model."""

from __future__ import annotations

import numpy as np
from textual.widgets import Static

from tierlab import ASSETS_DIR
from tierlab.app.tui.app import TierlabApp
from tierlab.app.tui.chat import ChatMessage
from tierlab.app.tui.drilldown import TOP_PROBS, DrillDownPane
from tierlab.app.tui.overlay import RAMP
from tierlab.engine.events import LEVEL_RAM
from tierlab.engine.options import EngineOptions
from tierlab.widgets.heatmap import ExpertHeatmap

from test_app import ask, ready, record_notes, wait_for

SHIPPED = ASSETS_DIR / "tiny-moe"


def shipped_app(tmp_path, cache: int = 12) -> TierlabApp:
    app = TierlabApp(EngineOptions(SHIPPED, cache), sessions_dir=tmp_path / "sessions")
    return record_notes(app)


def lru_from_events(events, layer: int, resident: set[int]) -> list[int]:
    """The RAM cache's LRU order rebuilt from the routing records alone: within a token the store
    takes the experts already in RAM first, then the misses, each group in rank order."""
    last: dict[int, tuple[int, int, int]] = {}
    for t, event in enumerate(events):
        for route in event.layers:
            if route.layer != layer:
                continue
            for rank, (e, level) in enumerate(zip(route.chosen, route.level)):
                if e >= 0:
                    last[int(e)] = (t, 0 if level == LEVEL_RAM else 1, rank)
    return sorted(resident, key=lambda e: last[e])


async def test_drilldown_shows_the_layers_router_probabilities_and_lru_order(tmp_path):
    app = shipped_app(tmp_path)
    events = []
    async with app.run_test(size=(120, 40)) as pilot:
        await ready(pilot)
        app.engine.subscribe(events.append)
        await ask(pilot, "Once upon a time", max_tokens=6)
        heatmap = app.query_one(ExpertHeatmap)
        heatmap.focus()
        await pilot.press("down", "down", "down")
        assert heatmap.cursor[0] == 3
        await pilot.press("enter")
        await pilot.pause()
        screen = app.query_one(DrillDownPane)
        assert app.focused is screen and screen.shown_layer == 3
        detail = screen.detail
        route = next(r for r in events[-1].layers if r.layer == 3)
        probs = np.asarray(route.probs)
        assert probs.shape == (32,) and abs(float(probs.sum()) - 1.0) < 1e-4
        expected = sorted(range(32), key=lambda e: (-probs[e], e))[:TOP_PROBS]
        assert [p.expert for p in detail.probs[:TOP_PROBS]] == expected
        assert [round(p.prob, 6) for p in detail.probs[:TOP_PROBS]] == [round(float(probs[e]), 6) for e in expected]
        assert {p.expert for p in detail.probs if p.chosen} == {int(e) for e in route.chosen if e >= 0}
        body = str(screen.query_one("#drill-body", Static).render())
        assert f"E{expected[0]}" in body and f"{100 * probs[expected[0]]:6.2f}%" in body
        # the RAM cache in LRU order, as the store holds it and as the events imply
        resident = {int(e) for e in np.flatnonzero(np.asarray(app.engine.residency(3)) == LEVEL_RAM)}
        assert set(detail.ram_lru) == resident and len(resident) == 12
        assert detail.ram_lru == lru_from_events(events, 3, resident)
        assert detail.gpu == []
        # hit rates from the meters of the window shown, bytes from its misses
        fold = app.watch.fold
        assert detail.realised == fold.layer_hit_rates()[3] and detail.realised is not None
        assert detail.shadow == fold.layer_shadow_rates()[3]
        assert detail.misses == fold.layer_misses[3] > 0
        assert detail.bytes_read == detail.misses * app.engine.store_stats().blob_nbytes
        await wait_for(pilot, lambda: app.watch.oracle.latest_reading is not None)
        screen.redraw()
        assert screen.detail.oracle is not None and screen.detail.oracle >= 0.0
        # up moves to the layer above; live: a new reply changes the routing shown
        await pilot.press("up")
        assert screen.shown_layer == 2 and screen.detail.layer == 2
        shown_token = screen.detail.token
        await ask(pilot, "The end", max_tokens=3)
        assert screen.is_attached
        await wait_for(pilot, lambda: screen.detail.token == app.watch.tokens_seen - 1 > shown_token, timeout=10)
        screen.focus()
        await pilot.press("escape")
        await pilot.pause()
        assert not list(app.query(DrillDownPane))


async def test_double_click_on_a_heatmap_cell_opens_its_layer(tmp_path):
    app = shipped_app(tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        await ready(pilot)
        await ask(pilot, "Hello", max_tokens=2)
        heatmap = app.query_one(ExpertHeatmap)
        spot = next((x, y) for y in range(heatmap.size.height) for x in range(heatmap.size.width)
                    if (cell := heatmap.cell_at(x, y)) is not None and cell[1] >= 4)
        await pilot.double_click(heatmap, offset=spot)
        await pilot.pause()
        pane = app.query_one(DrillDownPane)
        assert pane.shown_layer == heatmap.cursor[0] == heatmap.cell_at(*spot)[1]


def token_cells(message: ChatMessage):
    """(screen offset, click action) of every cell of the message that pins a token."""
    region = message.content_region
    found = []
    for y in range(region.y, region.bottom):
        for x in range(region.x, region.right):
            style = message.app.screen.get_style_at(x, y)
            action = style.meta.get("@click") if style.meta else None
            if action:
                found.append(((x, y), action, style))
    return found


def coloured(style) -> bool:
    """The cell is on one of the overlay's colours (not the message's own background)."""
    return style.bgcolor is not None and style.bgcolor.name in RAMP


def seq_of(action: str) -> int:
    """The pass number in an `app.select_token(N)` action."""
    assert action.startswith("app.select_token(")
    return int(action[len("app.select_token("):-1])


async def test_overlay_colours_tokens_and_a_click_pins_a_token_in_the_heatmap(tmp_path):
    app = shipped_app(tmp_path, cache=8)
    async with app.run_test(size=(120, 40)) as pilot:
        await ready(pilot)
        reply = await ask(pilot, "Once upon a time", max_tokens=12)
        assert len(reply.tokens) == 12
        await pilot.press("ctrl+o")
        await pilot.pause()
        assert app.overlay.measure == "misses"
        assert "RAM misses" in str(app.query_one("#chat").border_subtitle)
        records = {seq: app.overlay.ring.get(seq) for _, seq in reply.tokens}
        assert max(r.misses for r in records.values()) > 0
        # every token on screen is clickable; it has a background exactly when it missed
        cells = token_cells(reply)
        seqs = {seq_of(action) for _, action, _ in cells}
        assert seqs <= set(records) and len(seqs) >= 10
        top = max(r.misses for r in records.values())
        for _, action, style in cells:
            count = records[seq_of(action)].misses
            assert coloured(style) == (count > 0), (action, count)
            if count == top:
                assert style.bgcolor.name == "#9c1c1c"
        # the swap measure: the lever is off, so nothing swaps and nothing is coloured
        await pilot.press("ctrl+o")
        await pilot.pause()
        assert app.overlay.measure == "swaps"
        assert not any(coloured(style) for _, _, style in token_cells(reply))
        await pilot.press("ctrl+o")
        await pilot.pause()
        assert app.overlay.measure == "kl"
        # a click on a token shows its own routes in the heatmap
        cells = token_cells(reply)
        assert cells, "no clickable token on screen"
        (x, y), action, _ = cells[len(cells) // 2]
        seq = seq_of(action)
        record = app.overlay.ring.get(seq)
        assert seq != app.overlay.ring.last_seq
        await pilot.click(offset=(x, y))
        await pilot.pause()
        assert app.overlay.pinned == seq
        heatmap = app.query_one(ExpertHeatmap)
        assert heatmap.mode == "token" and f"token {seq}" in str(heatmap.border_title)
        expected = np.zeros_like(heatmap.data.chosen)
        for row, layer in enumerate(record.layers):
            expected[layer, record.chosen[row][record.chosen[row] >= 0]] = True
        assert np.array_equal(heatmap.data.chosen, expected)
        assert not np.array_equal(expected, app.watch.heatmap_data().chosen)  # not the latest token's
        # the same token again: back to the live view
        await pilot.click(offset=(x, y))
        await pilot.pause()
        assert app.overlay.pinned is None and heatmap.border_title == "Experts"
        assert np.array_equal(heatmap.data.chosen, app.watch.heatmap_data().chosen)
        # off: the plain text again
        await pilot.press("ctrl+o")
        await pilot.pause()
        assert app.overlay.measure is None
        assert not token_cells(reply)


def test_token_ring_keeps_the_last_passes_of_a_real_engine():
    from tierlab.app.tui.overlay import TokenRing

    engine = EngineOptions(SHIPPED, 12).open()
    events = []
    ring = TokenRing(size=5)
    try:
        engine.subscribe(events.append)
        ring.attach(engine)
        ids = engine.tokenizer.encode("Once upon a time")
        produced = list(engine.generate(ids, max_new_tokens=6))
        ring.detach()
    finally:
        engine.close()
    assert len(produced) == 6 and ring.count == len(events) == len(ids) + 6  # the last token is fed too
    assert len(ring.records) == 5 and ring.get(ring.count - 6) is None and ring.get(ring.count) is None
    for seq in range(ring.count - 5, ring.count):
        record, event = ring.get(seq), events[seq]
        assert record.token_id == event.token_id and record.phase == event.phase
        assert record.misses == sum(r.ram_misses for r in event.layers)
        assert record.layers == tuple(r.layer for r in event.layers)
        assert np.array_equal(record.chosen, np.stack([r.chosen for r in event.layers]))
