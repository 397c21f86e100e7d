"""How much the terminal app costs the engine, for docs/benchmarks.md.

    python tools/app_bench.py [--model DIR] [--tokens 64] [--rounds 3]

Decode tok/s of the same greedy chat reply, headless (`Engine.generate`, as
`tierlab generate` runs it) and inside the app (`TierlabApp` under
`run_test` at 160x48, heatmap and meters live), interleaved, median of the
rounds; tok/s is measured between the first and the last decode token, so
prompt processing is left out of both. Then the app's start time in a real
terminal (tmux): to its first frame, and to the model being loaded.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import tierlab

PROMPT = "Write a function that reads a config file and returns a dict."


class DecodeClock:
    """Timestamps of decode events, to time decoding alone."""

    def __init__(self) -> None:
        self.stamps: list[float] = []

    def __call__(self, event) -> None:
        if event.phase == "decode":
            self.stamps.append(time.perf_counter())

    def tok_s(self) -> float:
        s = self.stamps
        return (len(s) - 1) / (s[-1] - s[0]) if len(s) > 1 else 0.0


def headless(model: Path, tokens: int) -> tuple[float, int]:
    from tierlab.engine.model import load_engine

    engine = load_engine(model)
    ids = engine.tokenizer.encode(engine.tokenizer.render_chat([{"role": "user", "content": PROMPT}]))
    clock = DecodeClock()
    engine.subscribe(clock)
    n = len(list(engine.generate(ids, tokens)))
    engine.close()
    return clock.tok_s(), n


async def in_app(model: Path, tokens: int) -> tuple[float, int]:
    from textual.widgets import Input

    from tierlab.app.tui.app import TierlabApp
    from tierlab.engine.options import EngineOptions
    from tierlab.widgets.knob import Knob

    app = TierlabApp(EngineOptions(model))
    clock = DecodeClock()
    async with app.run_test(size=(160, 48)) as pilot:
        while app.engine is None:
            await pilot.pause(0.05)
        app.engine.subscribe(clock)
        app.query_one("#max-tokens", Knob).value = tokens
        before = app.replies
        prompt = app.query_one("#prompt", Input)
        prompt.focus()
        prompt.value = PROMPT
        await pilot.press("enter")
        while app.replies == before:  # not pilot.pause: it messages every widget and forces a frame each time
            await asyncio.sleep(0.05)
    return clock.tok_s(), len(clock.stamps) + 1


def start_times(model: Path, timeout: float = 60.0) -> tuple[float, float]:
    """Seconds from launch to the first frame and to the loaded model, in tmux at 160x48."""
    tierlab_bin = Path(sys.executable).parent / "tierlab"
    subprocess.run(["tmux", "kill-session", "-t", "tlbench"], capture_output=True)
    t0 = time.perf_counter()
    subprocess.run(["tmux", "new-session", "-d", "-s", "tlbench", "-x", "160", "-y", "48",
                    f"{tierlab_bin} app --model {model}"], check=True)
    first = loaded = None
    try:
        while time.perf_counter() - t0 < timeout and loaded is None:
            screen = subprocess.run(["tmux", "capture-pane", "-t", "tlbench", "-p"], capture_output=True,
                                    text=True).stdout
            now = time.perf_counter() - t0
            if first is None and "tierlab" in screen:
                first = now
            if first is not None and model.name in screen and "loading" not in screen.lower():
                loaded = now
            time.sleep(0.02)
    finally:
        subprocess.run(["tmux", "kill-session", "-t", "tlbench"], capture_output=True)
    return first or float("nan"), loaded or float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=tierlab.ASSETS_DIR / "tiny-moe")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    headless(args.model, 4)  # compile every kernel first
    rows = {"headless": [], "app": []}
    for _ in range(args.rounds):
        rows["headless"].append(headless(args.model, args.tokens)[0])
        rows["app"].append(asyncio.run(in_app(args.model, args.tokens))[0])
    h, a = statistics.median(rows["headless"]), statistics.median(rows["app"])
    print(f"model {args.model.name}, {args.tokens} tokens, {args.rounds} interleaved rounds")
    print("| run | decode tok/s (median) | rounds |")
    print("|---|---:|---|")
    for name, values in rows.items():
        print(f"| {name} | {statistics.median(values):.1f} | {', '.join(f'{v:.1f}' for v in values)} |")
    print(f"\napp / headless = {a / h:.2f}")
    if shutil.which("tmux"):
        firsts, loads = zip(*(start_times(args.model) for _ in range(args.rounds)))
        print(f"start in tmux: first frame {statistics.median(firsts):.2f} s, model loaded "
              f"{statistics.median(loads):.2f} s (medians of {args.rounds})")


if __name__ == "__main__":
    main()
