"""The kernel warm-up: a session after loading compiles nothing, and the loaded engine is left as it was."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys

import numpy as np

import tierlab
from conftest import run_cli
from tierlab.app.cli.engine_options import CompileProgress
from tierlab.engine.knobs import Knobs
from tierlab.engine.model import load_engine
from tierlab.engine.options import EngineOptions
from tierlab.engine.tiering import TierOptions
from tierlab.engine.warmup import STEPS, kernels, representative_layers

MODEL = tierlab.ASSETS_DIR / "tiny-moe"

# A session in a fresh process: the kernels' signatures after loading, then after a chat that
# moves every lever mid-reply, resizes the RAM cache, evaluates (all logits), samples, reads a
# long prompt and continues a conversation into its next turn.
SESSION = r"""
import json, sys
from tierlab.engine.conversation import Conversation
from tierlab.engine.options import EngineOptions
from tierlab.engine.tiering import TierOptions
from tierlab.engine.warmup import kernel_signatures, new_signatures

warm, tier = sys.argv[1] == "1", sys.argv[2] == "1"
engine = EngineOptions(cache=12, warmup=warm, knobs_from_env=False,
                       tier=TierOptions(enabled=tier, budget="0.002")).open()
before = kernel_signatures()
ids = engine.tokenizer.encode("Once upon a time there was a little cat who")
changes = {3: ("CACHE_ROUTE", "1"), 6: ("ROUTE_MODE", "prior"), 9: ("ROUTE_MODE", "cumprob"),
           10: ("ROUTE_P", "0.6"), 12: ("PILOT", "2"), 14: ("CACHE_ROUTE", "0"), 15: ("ROUTE_AGREE", "1")}
for i, token in enumerate(engine.generate(ids, max_new_tokens=18)):
    if i in changes:
        engine.knobs.set(*changes[i])
engine.set_cache_slots(32)
engine.knobs.set("PILOT", "0")
list(engine.generate(ids, max_new_tokens=4))
engine.prefill(ids, all_logits=True)
engine.set_cache_slots(5)
engine.knobs.set("CACHE_ROUTE", "1")
list(engine.generate(ids, max_new_tokens=4, temperature=0.8, top_p=0.9))
engine.prefill((ids * 40)[:300])  # a long prompt: any path a prompt's length selects
chat = Conversation(engine)  # a chat's next turn continues the sequence state with a prompt
reply = list(chat.generate(ids, max_new_tokens=3))
list(chat.generate(ids + reply + ids, max_new_tokens=3))
print(json.dumps({"new": new_signatures(before, kernel_signatures()), "tier": engine.tier_description() is not None}))
"""


# The app's oracle band in a fresh process: after the app's loading (the warm-up and the oracle's
# replays), a reply and the band's readings on its own thread compile nothing.
ORACLE = r"""
import json
from tierlab.app.lab.oracle import OracleBand
from tierlab.app.tui.app import warm_oracle_kernels
from tierlab.engine.options import EngineOptions
from tierlab.engine.warmup import kernel_signatures, new_signatures

engine = EngineOptions(cache=12, knobs_from_env=False).open()
warm_oracle_kernels()
before = kernel_signatures()
band = OracleBand(interval=0.05, n_experts=engine.config.n_experts)
engine.subscribe(band.add)
band.start()
list(engine.generate(engine.tokenizer.encode("Once upon a time"), max_new_tokens=8))
band.close()
reading = band.reading()
print(json.dumps({"new": new_signatures(before, kernel_signatures()), "lru": sorted(reading.lru_hit_by_size)}))
"""


def run_session(warm: bool, tier: bool = False) -> dict:
    done = subprocess.run([sys.executable, "-c", SESSION, "1" if warm else "0", "1" if tier else "0"],
                          capture_output=True, text=True, env=dict(os.environ), timeout=600)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_after_the_warm_up_a_session_compiles_nothing():
    assert run_session(warm=True)["new"] == {}


def test_without_the_warm_up_the_same_session_meets_new_signatures():
    """The check above can fail: skipping the warm-up leaves kernels for the session to compile."""
    new = run_session(warm=False)["new"]
    assert any("qmatvec" in name for name in new) and any("routing" in name for name in new), new


def test_after_the_apps_loading_the_oracle_band_compiles_nothing():
    done = subprocess.run([sys.executable, "-c", ORACLE], capture_output=True, text=True, env=dict(os.environ),
                          timeout=600)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["lru"] and result["new"] == {}


def test_with_a_gpu_tier_a_session_compiles_nothing(opencl_device):
    result = run_session(warm=True, tier=True)
    assert result["tier"] and result["new"] == {}


def test_every_kernel_is_cached_on_disk():
    import importlib
    import pkgutil

    import tierlab.engine

    for module in pkgutil.walk_packages(tierlab.engine.__path__, "tierlab.engine."):
        importlib.import_module(module.name)
    importlib.import_module("tierlab.app.lab.belady")
    found = kernels()
    assert len(found) > 30 and any(name.startswith("tierlab.app.lab.") for name in found)
    uncached = [name for name, kernel in found.items() if kernel.stats.cache_path is None]
    assert uncached == []


def decode(engine, n=10):
    ids = engine.tokenizer.encode("The little dog ran to the")
    logits = [engine.prefill(ids)]
    for i in range(n):
        if i == 4:
            engine.knobs.set("CACHE_ROUTE", "1")
        logits.append(engine.step(int(np.argmax(logits[-1]))))
    return np.stack(logits)


def test_the_warm_up_leaves_the_engine_as_loaded():
    # (PILOT stays off: its background loads make residency, and so the lever's choices, timing-dependent)
    plain = load_engine(MODEL, cache_slots=10, knobs=Knobs.from_env({}), tier=TierOptions(), warmup=False)
    warmed = load_engine(MODEL, cache_slots=10, knobs=Knobs.from_env({}), tier=TierOptions(), warmup=True)
    assert warmed.store_stats().ram_hits == warmed.store_stats().ram_misses == 0
    assert warmed.heat.sum() == 0 and warmed.tokens_timed == 0 and warmed.knobs.seq == 0
    assert warmed.meters() == plain.meters()
    assert np.isnan(warmed.router.logit_range_ema(0))
    assert not warmed.residency(0).any()
    a, b = decode(plain), decode(warmed)
    assert np.array_equal(a, b)  # bit for bit, lever on included
    assert plain.store_stats().hits.tolist() == warmed.store_stats().hits.tolist()
    for engine in (plain, warmed):
        engine.close()


def test_one_layer_of_each_kind_is_warmed():
    engine = load_engine(MODEL, warmup=False)
    layers = representative_layers(engine)
    kinds = [engine.layers[i].kind for i in layers]
    assert sorted(kinds) == ["full_attention", "linear_attention"]
    assert layers == [engine.config.layer_types.index("linear_attention"),
                      engine.config.layer_types.index("full_attention")]
    engine.close()


def test_progress_reports_every_step():
    heard = []
    engine = EngineOptions(MODEL).open(progress=lambda *a: heard.append(a))
    steps = [done for done, *_ in heard]
    assert steps[0] == 0 and steps[-1] == len(STEPS) and steps == sorted(steps)
    assert heard[-1][2] == "ready" and [a[2] for a in heard[:1]] == [STEPS[0].label]
    assert all(total == len(STEPS) for _, total, _, _ in heard)
    engine.close()


def test_cli_progress_lines():
    quiet = io.StringIO()
    progress = CompileProgress(quiet)
    for done in range(len(STEPS) + 1):
        progress(done, len(STEPS), "x", 0)
    progress.finish()
    assert quiet.getvalue() == ""  # everything came from the cache
    lines = io.StringIO()
    progress = CompileProgress(lines)
    progress(0, 7, "prompt and decode", 1)
    progress(0, 7, "prompt and decode", 2)
    progress(1, 7, "prompt token by token", 57)
    progress(2, 7, "routing maxrank", 57)
    progress(7, 7, "ready", 80)
    assert lines.getvalue().splitlines() == [
        "tierlab: compiling kernels 0/7 (prompt and decode, 1 compiled)",
        "tierlab: compiling kernels 1/7 (prompt token by token, 57 compiled)",
        "tierlab: compiling kernels 7/7 (ready, 80 compiled)",
    ]


def test_cli_is_quiet_once_the_cache_holds_the_kernels():
    first = run_cli("generate", "-n", "2", "--prompt", "Once")
    assert first.returncode == 0, first.stderr
    second = run_cli("generate", "-n", "2", "--prompt", "Once")
    assert second.returncode == 0 and "compiling kernels" not in second.stderr, second.stderr
