"""How much the terminal app costs the engine, and what its redraws cost, for docs/benchmarks.md.

    .venv/bin/python tools/app_bench.py [--model DIR] [--tokens 64] [--rounds 3]
    .venv/bin/python tools/app_bench.py --redraw [--layers 40] [--experts 256] [--tokens 64]

(the project's virtual environment: it has Textual, numba and tierlab itself)

Decode tok/s of the same greedy chat reply, headless (`Engine.generate`, as
`tierlab generate` runs it) and inside the app (`TierlabApp` under
`run_test` at 160x48, heatmap and meters live), both with every expert in
RAM, interleaved, median of the
rounds; tok/s is measured between the first and the last decode token, so
prompt processing is left out of both. Then the app's start time in a real
terminal (tmux): to its first frame, and to the model being loaded.

With --redraw: the cost of each redraw while a reply streams, on a model of
real routing shape (40 layers × 256 experts by default, tiny widths, written
by tests/app_models.py), at 160x48 and 220x60: the heatmap's render (every
frame that draws it) and the app's view update (`refresh_views` when it draws: heatmap
data, meters, plot), in milliseconds, median and worst, by the wall clock
(which includes waiting for the engine thread) and by the UI thread's own
CPU time (the redraw's cost).
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import subprocess
import sys
import threading
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
    """On a thread of its own, as the app decodes on its workers: a thread keeps the OpenMP
    team it opened until it exits, and with the main thread's team alive beside the app's,
    libgomp would count more threads than CPUs and stop spinning (engine/gomp_waits.py)."""
    result = []
    worker = threading.Thread(target=lambda: result.append(_headless(model, tokens)))
    worker.start()
    worker.join()
    if not result:
        raise SystemExit("the headless run failed (its traceback is above)")
    return result[0]


def _headless(model: Path, tokens: int) -> tuple[float, int]:
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

    from tierlab.engine.config import load_config

    # every expert in RAM, as headless: the app's own first-run cache (3/8 of the experts,
    # options.first_run_slots) would make this compare two caches, not the app's cost
    app = TierlabApp(EngineOptions(model, cache=load_config(model).n_experts))
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


async def redraw_costs(model: Path, tokens: int, size: tuple[int, int]) -> dict[str, list[tuple[float, float]]]:
    """Milliseconds (wall clock, and the UI thread's own CPU time) of each heatmap render and each
    view update while one reply streams; the wall clock includes waiting for the engine thread."""
    from textual.widgets import Input

    from tierlab.app.tui.app import TierlabApp
    from tierlab.engine.options import EngineOptions
    from tierlab.widgets.heatmap import ExpertHeatmap
    from tierlab.widgets.knob import Knob

    app = TierlabApp(EngineOptions(model))
    costs: dict[str, list[tuple[float, float]]] = {"heatmap render": [], "view update": []}
    streaming = [False]

    def timed(name, function, drew=lambda before: True):
        def run(*args, **kwargs):
            before = heatmap.data
            start, cpu = time.perf_counter(), time.thread_time()
            try:
                return function(*args, **kwargs)
            finally:
                if streaming[0] and drew(before):
                    costs[name].append((1000 * (time.perf_counter() - start), 1000 * (time.thread_time() - cpu)))
        return run

    async with app.run_test(size=size) as pilot:
        while app.engine is None:
            await pilot.pause(0.05)
        heatmap = app.query_one(ExpertHeatmap)
        heatmap.render = timed("heatmap render", heatmap.render)
        # a view update that found nothing new returns at once: only those that drew count
        app.refresh_views = timed("view update", app.refresh_views, lambda before: heatmap.data is not before)
        app.query_one("#max-tokens", Knob).value = tokens
        before = app.replies
        prompt = app.query_one("#prompt", Input)
        prompt.focus()
        prompt.value = PROMPT
        streaming[0] = True
        await pilot.press("enter")
        while app.replies == before:
            await asyncio.sleep(0.05)
        streaming[0] = False
    return costs


def redraw_report(args) -> None:
    import tempfile

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from app_models import build_wide_moe

    with tempfile.TemporaryDirectory() as folder:
        model = build_wide_moe(Path(folder) / f"synthetic-{args.layers}x{args.experts}", layers=args.layers,
                               experts=args.experts)
        headless(model, 4)  # compile every kernel first
        print(f"{args.layers} layers × {args.experts} experts (tiny widths), {args.tokens} tokens per reply, "
              f"{args.rounds} rounds per size")
        print("| size | what | frames | wall ms median | wall ms worst | UI-thread CPU ms median | CPU ms worst |")
        print("|---|---|---:|---:|---:|---:|---:|")
        for size in ((160, 48), (220, 60)):
            merged: dict[str, list[tuple[float, float]]] = {}
            for _ in range(args.rounds):
                for name, values in asyncio.run(redraw_costs(model, args.tokens, size)).items():
                    merged.setdefault(name, []).extend(values)
            for name, values in merged.items():
                if values:
                    wall, cpu = [v[0] for v in values], [v[1] for v in values]
                    print(f"| {size[0]}x{size[1]} | {name} | {len(values)} | {statistics.median(wall):.1f} | "
                          f"{max(wall):.1f} | {statistics.median(cpu):.1f} | {max(cpu):.1f} |")


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
    parser.add_argument("--redraw", action="store_true", help="time the redraws on a model of real routing shape")
    parser.add_argument("--layers", type=int, default=40)
    parser.add_argument("--experts", type=int, default=256)
    args = parser.parse_args()
    if args.redraw:
        redraw_report(args)
        return
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
