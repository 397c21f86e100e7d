"""The app's first run on the shipped model: loading progress, a RAM cache the lever can work on,
and a cache knob that never freezes the screen while a reply streams."""

from __future__ import annotations

import asyncio
import threading

from textual.widgets import Input, Switch

import tierlab
from test_app import ask, ready, wait_for
from tierlab.app.tui.app import TierlabApp
from tierlab.app.tui.knob_panel import CACHE_SLOTS, knob_id
from tierlab.engine.options import EngineOptions, first_run_slots
from tierlab.engine.warmup import STEPS
from tierlab.widgets.knob import Knob

MODEL = tierlab.ASSETS_DIR / "tiny-moe"


def hit_rate_during(engine, before) -> float:
    after = engine.store_stats()
    hits, misses = after.ram_hits - before.ram_hits, after.ram_misses - before.ram_misses
    return hits / (hits + misses)


def test_first_run_rule():
    assert first_run_slots(32, 4) == 12  # the shipped model
    assert first_run_slots(8, 2) == 4
    assert first_run_slots(256, 8) == 96
    assert first_run_slots(4, 4) == 3  # always one short of every expert
    assert first_run_slots(1, 1) == 1


async def test_the_first_run_shows_the_lever_at_work(tmp_path):
    app = TierlabApp(EngineOptions(MODEL), sessions_dir=tmp_path)
    loading: list[str] = []
    show_loading = app._show_loading
    app._show_loading = lambda text: (loading.append(text), show_loading(text))  # type: ignore[method-assign]
    async with app.run_test(size=(120, 36)) as pilot:
        await ready(pilot)
        engine = app.engine
        assert loading[0].startswith(f"compiling kernels 0/{len(STEPS)}")
        assert any(text.startswith(f"compiling kernels {len(STEPS)}/{len(STEPS)}") for text in loading)
        assert engine.cache_slots() == 12
        stats = engine.store_stats()
        mib = 12 * stats.blob_nbytes * sum(engine.config.moe_layers) / 2**20
        assert f"cache 12/32 · {mib:.3g} MiB" in app.sub_title
        assert app.query_one(f"#{knob_id(CACHE_SLOTS)}", Knob).value == 12

        await ask(pilot, "Once upon a time", max_tokens=12)  # the cold first reply
        await pilot.press("ctrl+l")  # the same prompt again, on the cache it left
        before = engine.store_stats()
        await ask(pilot, "Once upon a time", max_tokens=12)
        off_hit = hit_rate_during(engine, before)
        assert engine.meters()["swap"] in (None, 0.0)

        switch = app.query_one(f"#{knob_id('CACHE_ROUTE')} Switch", Switch)
        switch.focus()
        await pilot.press("space")
        await pilot.pause()
        assert engine.knobs.get("CACHE_ROUTE") is True
        await pilot.press("ctrl+l")
        before = engine.store_stats()
        await ask(pilot, "Once upon a time", max_tokens=12)
        on_hit = hit_rate_during(engine, before)
        assert engine.meters()["swap"] > 0
        assert on_hit > off_hit


async def test_moving_the_cache_knob_during_a_reply_keeps_the_screen_live(tmp_path):
    app = TierlabApp(EngineOptions(MODEL), sessions_dir=tmp_path)
    async with app.run_test(size=(120, 36)) as pilot:
        await ready(pilot)
        engine = app.engine
        held, reached = threading.Event(), threading.Event()
        seen = [0]

        def hold_the_engine(event) -> None:  # runs inside the engine's forward pass, holding its lock
            seen[0] += 1
            if seen[0] == 20:
                reached.set()
                held.wait(timeout=60)

        engine.subscribe(hold_the_engine)
        app.query_one("#max-tokens", Knob).value = 40
        prompt = app.query_one("#prompt", Input)
        prompt.focus()
        prompt.value = "Once upon a time"
        await pilot.press("enter")
        await wait_for(pilot, reached.is_set)
        assert app.generating

        knob = app.query_one(f"#{knob_id(CACHE_SLOTS)}", Knob)
        knob.focus()
        await asyncio.wait_for(pilot.press("left"), timeout=10)
        assert knob.value == 11  # the knob shows the size on its way
        assert engine.cache_slots() == 12  # the engine is mid-token: not applied yet
        await pilot.pause()
        assert "cache 12/32" in app.sub_title and "→ 11" in app.sub_title
        prompt.focus()
        await asyncio.wait_for(pilot.press("a", "b", "c"), timeout=10)
        assert prompt.value == "abc"  # key presses are handled while the engine is held
        assert app.generating and engine.cache_slots() == 12

        held.set()
        await wait_for(pilot, lambda: not app.generating)
        await wait_for(pilot, lambda: engine.cache_slots() == 11)
        await wait_for(pilot, lambda: "cache 11/32" in app.sub_title)
        assert "→" not in app.sub_title
        assert "cache=11" in [mark.label for mark in app.watch.history.marks]
        engine.unsubscribe(hold_the_engine)


async def test_the_first_run_cache_stays_within_the_memory_budget(tmp_path):
    """A budget that leaves room for 5 slots per layer caps the app's first-run cache (12 of 32)."""
    generous = EngineOptions(MODEL, ram_gb=64).budget_plan()
    fixed = generous.dense + generous.state + generous.runtime
    ram_gb = (fixed + 5.5 * generous.slot_bytes) / 2**30
    assert EngineOptions(MODEL, ram_gb=ram_gb).budget_plan().slots == 5
    app = TierlabApp(EngineOptions(MODEL, ram_gb=ram_gb), sessions_dir=tmp_path)
    async with app.run_test(size=(120, 36)) as pilot:
        await ready(pilot)
        assert app.engine.cache_slots() == 5
