"""A picture of the app after a real exchange, for docs: the meters with a live shadow and oracle band.

Usage: .venv/bin/python tools/app_screenshot.py OUT.svg [--size 160x48]
Opens the shipped model at its first-run cache (12 of 32 slots), asks one
prompt with the lever off, turns CACHE_ROUTE on and ROUTE_J to 1 in the knobs panel, asks again,
and saves the screen as SVG.
"""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

from textual.widgets import Input

from tierlab.app.tui.app import TierlabApp
from tierlab.app.tui.knob_panel import knob_id
from tierlab.engine.options import EngineOptions
from tierlab.widgets.knob import Knob


async def shoot(out: Path, size: tuple[int, int]) -> None:
    app = TierlabApp(EngineOptions(), sessions_dir=out.parent / "tierlab-sessions")
    async with app.run_test(size=size) as pilot:
        while app.engine is None:
            await pilot.pause(0.1)
        app.query_one("#max-tokens", Knob).value = 24
        for text, lever in (("Once upon a time", False), ("The little dog ran", True)):
            if lever:  # through the knobs panel, as a user moves them
                await pilot.click(f"#{knob_id('CACHE_ROUTE')} Switch")
                app.query_one(f"#{knob_id('ROUTE_J')}", Knob).value = 1
                await pilot.pause(0.2)
            before = app.replies
            prompt = app.query_one("#prompt", Input)
            prompt.focus()
            prompt.value = text
            await pilot.press("enter")
            while app.replies == before:
                await pilot.pause(0.1)
        await pilot.pause(0.5)
        app.refresh_views(force=True)
        await pilot.pause(0.2)
        out.write_text(app.export_screenshot())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--size", default="160x48", help="columns x rows (default 160x48)")
    args = parser.parse_args()
    cols, rows = (int(v) for v in args.size.lower().split("x"))
    asyncio.run(shoot(args.out, (cols, rows)))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
