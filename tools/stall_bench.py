"""Compile stalls as a new user meets them: start to "ready", the first token, a lever toggled mid-reply.

Each run is a fresh Python process with an empty numba cache (a fresh clone's
first start) or with the cache the previous run filled (every later start).
In the child: open the model as the app does (its first-run RAM cache), then
one chat reply with CACHE_ROUTE toggled on at token TOGGLE, ROUTE_MODE=prior
at 2*TOGGLE and PILOT=1 at 3*TOGGLE, and a RAM cache resize requested from
another thread at 4*TOGGLE (as the app's cache worker does). Reported: seconds
from process start to ready, the first token's latency after ready, and the
largest gap between two tokens (overall, and at each change).

    python tools/stall_bench.py [--model DIR] [--tokens 60] [--cache N] [--no-warmup] [--app]
                                [--numba-cache DIR --starts N] [--cold-page-cache]

With --numba-cache the runs use that folder as numba's cache and keep it: the
first start fills it, and --starts later starts are timed on it (several trees
interleaved on one cache: numba keys its cache by each kernel's source).

With --cold-page-cache each start begins with the model folder's files
dropped from the page cache (`POSIX_FADV_DONTNEED`), as after a reboot: the
weights then come from the disk.

With --app the same is measured in the app itself (TierlabApp under
`App.run_test()`, headless): ready is the engine appearing in the app, the
first token follows a prompt typed and sent with Enter, and CACHE_ROUTE is
switched on at --toggle through the app's knob handler.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHILD = r"""
import json, sys, threading, time
from tierlab.engine.config import load_config
from tierlab.engine.options import EngineOptions, first_run_slots
from pathlib import Path
from numba.core import event

model, tokens, toggle, warm = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1"
cfg = load_config(model)
slots = int(sys.argv[5]) or first_run_slots(cfg.n_experts, cfg.top_k)
engine = EngineOptions(model, slots, knobs_from_env=False, warmup=warm).open()
print("ready", flush=True)
t_ready = time.perf_counter()
times, changes = [], {}
late = []  # (token index, kernel and argument types) compiled after ready, on any thread


class Heard(event.Listener):
    def on_start(self, ev):
        pass

    def on_end(self, ev):
        args = ", ".join(str(a) for a in ev.data["args"])
        late.append((len(times), f"{ev.data['dispatcher'].py_func.__qualname__}({args})"))


event.register("numba:compile", Heard())
tok = engine.tokenizer
prompt = tok.render_chat([{"role": "user", "content": "Tell me a story about a cat."}]) if getattr(tok, "chat_template", None) else "Once upon a time"
ids = tok.encode(prompt)
resize = None
first_phases = {}
for i, token in enumerate(engine.generate(ids, max_new_tokens=tokens, eos_ids=[])):
    times.append(time.perf_counter())
    if i == 0:  # where the first token's time went (the prompt's pass): engine timers, seconds
        first_phases = {k: round(v, 3) for k, v in engine.timers.items() if v >= 0.001}
    if i == toggle:
        engine.knobs.set("CACHE_ROUTE", "1"); changes["CACHE_ROUTE=1"] = i
    elif i == 2 * toggle:
        engine.knobs.set("ROUTE_MODE", "prior"); changes["ROUTE_MODE=prior"] = i
    elif i == 3 * toggle:
        engine.knobs.set("PILOT", "1"); changes["PILOT=1"] = i
    elif i == 4 * toggle:
        resize = threading.Thread(target=engine.set_cache_slots, args=(max(1, slots - 4),))
        resize.start(); changes[f"cache={max(1, slots - 4)}"] = i
if resize is not None:
    resize.join()
gaps = [b - a for a, b in zip(times, times[1:])]
at = {name: max(gaps[i:i + 3]) * 1000 for name, i in changes.items() if i < len(gaps)}
print(json.dumps({"first_token_s": times[0] - t_ready, "max_gap_ms": max(gaps) * 1000,
                  "median_gap_ms": sorted(gaps)[len(gaps) // 2] * 1000, "gap_after_change_ms": at,
                  "tokens": len(times), "slots": slots, "n_experts": cfg.n_experts,
                  "cache_after": engine.cache_slots(), "prompt_tokens": len(ids),
                  "first_token_phases": first_phases,
                  "compiled_before_first_token": [k for i, k in late if i == 0],
                  "compiled_after_ready": [k for _, k in late]}))
"""


APP_CHILD = r"""
import asyncio, json, sys, tempfile, time
from pathlib import Path
from textual.widgets import Input
from tierlab.app.tui.app import TierlabApp
from tierlab.engine.options import EngineOptions
from tierlab.widgets.knob import Knob
from numba.core import event

model, tokens, toggle, warm = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1"


async def main():
    app = TierlabApp(EngineOptions(model, warmup=warm), sessions_dir=tempfile.mkdtemp())
    async with app.run_test(size=(160, 48)) as pilot:
        while app.engine is None:
            await pilot.pause(0.02)
        print("ready", flush=True)
        t_ready = time.perf_counter()
        compiled = []  # kernels numba compiles after ready, on any thread (the oracle's too)

        class Heard(event.Listener):
            def on_start(self, ev):
                pass

            def on_end(self, ev):
                compiled.append(ev.data["dispatcher"].py_func.__qualname__)

        event.register("numba:compile", Heard())
        times = []
        loop = asyncio.get_running_loop()

        def heard(ev):
            if ev.phase == "decode" or not times:
                times.append(time.perf_counter())
                if len(times) == toggle:  # the UI thread switches the lever, as the knob's handler does
                    loop.call_soon_threadsafe(app.set_engine_knob, "CACHE_ROUTE", True)

        app.engine.subscribe(heard)
        app.engine.eos_ids = lambda: []  # a reply of exactly `tokens` tokens
        app.query_one("#max-tokens", Knob).value = tokens
        prompt = app.query_one("#prompt", Input)
        prompt.focus()
        prompt.value = "Tell me a story about a cat."
        await pilot.press("enter")
        changed = toggle
        while app.replies == 0:
            await pilot.pause(0.02)
        await pilot.pause(1.5)  # the oracle's next refresh, on its own thread
        gaps = [b - a for a, b in zip(times, times[1:])]
        print(json.dumps({"first_token_s": times[0] - t_ready, "max_gap_ms": max(gaps) * 1000,
                          "median_gap_ms": sorted(gaps)[len(gaps) // 2] * 1000,
                          "gap_after_change_ms": {"CACHE_ROUTE=1": max(gaps[changed - 1:changed + 2]) * 1000},
                          "tokens": len(times), "slots": app.engine.cache_slots(),
                            "n_experts": app.engine.config.n_experts, "cache_after": app.engine.cache_slots(),
                          "compiled_after_ready": compiled}),
              flush=True)


asyncio.run(main())
"""


def run_once(model: Path, tokens: int, toggle: int, warm: bool, cache_dir: str, app: bool = False,
             cache: int = 0) -> dict:
    env = dict(os.environ, NUMBA_CACHE_DIR=cache_dir)
    start = time.perf_counter()
    child = subprocess.Popen([sys.executable, "-c", APP_CHILD if app else CHILD, str(model), str(tokens), str(toggle),
                              "1" if warm else "0", str(cache)],
                             stdout=subprocess.PIPE, text=True, env=env)
    assert child.stdout is not None
    line = child.stdout.readline()
    if line.strip() != "ready":
        child.wait()
        raise SystemExit(f"the child did not get ready: {line!r}")
    ready_s = time.perf_counter() - start
    result = json.loads(child.stdout.read().strip().splitlines()[-1])
    if child.wait() != 0:
        raise SystemExit("the child failed")
    return {"ready_s": ready_s, **result}


def drop_from_page_cache(folder: Path) -> int:
    """Evict every file of the model folder from the page cache; returns the bytes dropped."""
    from tierlab.engine.readahead import evict

    return sum(evict(path) for path in sorted(folder.iterdir()) if path.is_file())


def compiled_text(names: list[str]) -> str:
    if not names:
        return "none"
    return f"{len(names)} ({', '.join(names[:4])}{', ...' if len(names) > 4 else ''})"


def main() -> int:
    import tierlab

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=tierlab.ASSETS_DIR / "tiny-moe")
    parser.add_argument("--tokens", type=int, default=60)
    parser.add_argument("--toggle", type=int, default=10, help="token of the first change (default 10)")
    parser.add_argument("--no-warmup", action="store_true", help="also measure without the kernel warm-up")
    parser.add_argument("--app", action="store_true",
                        help="run the app (TierlabApp under run_test, 160x48) instead of the engine alone; "
                        "CACHE_ROUTE is switched on at --toggle as the knob's handler does")
    parser.add_argument("--cache", type=int, default=0,
                        help="RAM cache slots per layer for the engine child (default: the app's first-run cache)")
    parser.add_argument("--numba-cache", type=Path, default=None,
                        help="numba's cache folder, kept (default: a new empty one per mode, then one start on it)")
    parser.add_argument("--starts", type=int, default=1, help="with --numba-cache: starts timed on it (default 1)")
    parser.add_argument("--cold-page-cache", action="store_true",
                        help="drop the model's files from the page cache before each start")
    args = parser.parse_args()
    modes = [True] + ([False] if args.no_warmup else [])
    for warm in modes:
        with tempfile.TemporaryDirectory(prefix="tierlab-numba-") as cache_dir:
            if args.numba_cache is not None:
                args.numba_cache.mkdir(parents=True, exist_ok=True)
                cache_dir = str(args.numba_cache)
                starts = ["given cache"] * max(1, args.starts)
            else:
                starts = ["empty cache", "cached"]
            for start in starts:
                if args.cold_page_cache:
                    dropped = drop_from_page_cache(args.model)
                    start += f", {dropped / 1e6:.0f} MB dropped from the page cache"
                r = run_once(args.model, args.tokens, args.toggle, warm, cache_dir, args.app, args.cache)
                changes = ", ".join(f"{k} {v:.0f}" for k, v in r["gap_after_change_ms"].items())
                print(f"{'app' if args.app else 'engine'} | {'warm-up' if warm else 'no warm-up'} | {start} | "
                      f"ready {r['ready_s']:.1f} s | "
                      f"first token {r['first_token_s'] * 1000:.0f} ms"
                      + (f" ({r['prompt_tokens']}-token prompt)" if "prompt_tokens" in r else "")
                      + f" | max gap {r['max_gap_ms']:.0f} ms "
                      f"(median {r['median_gap_ms']:.1f}) | gap at change (ms): {changes} | "
                      f"cache {r['slots']}/{r['n_experts']} -> {r['cache_after']}"
                      + (f" | first token's phases (s): {r['first_token_phases']}" if r.get("first_token_phases") else "")
                      + (f" | compiled after ready: {compiled_text(r['compiled_after_ready'])}"
                         if "compiled_after_ready" in r else ""), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
