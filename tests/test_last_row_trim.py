"""A prompt's last layer runs only the experts of its last token when only the next token's
logits are wanted: the same logits bit for bit, the same routes, meters, heat and residency,
and fewer experts computed."""

from __future__ import annotations

import numpy as np
import pytest

from tierlab.engine.expert_store import ExpertStore
from tierlab.engine.knobs import Knobs
from tierlab.engine.model import load_engine
from tierlab.engine.moe import MoEBlock

from prompt_routes import routes_of, shipped_and_int4

WARM = [int(i) for i in np.random.default_rng(21).integers(2, 250, 7)]
PROMPT = [int(i) for i in np.random.default_rng(22).integers(2, 250, 40)]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return shipped_and_int4(tmp_path_factory.mktemp("trim"))


def counts_of(summary: dict) -> dict:
    """A meter summary without its timings (which the trim is there to change)."""
    return {k: v for k, v in summary.items() if not (k.endswith("_ms") or k in ("tok_s", "ms_per_token"))}


def run(folder, slots, knobs, trim, monkeypatch):
    """Warm-up prompt, then PROMPT (next-token logits only), then 4 greedy tokens; with `trim`
    False the last layer computes every token's experts (the rows are then simply not read).
    Returns the engine, the prompt's events, its logits, the greedy ids and the experts computed."""
    computed = []
    real_batch = ExpertStore.forward_batch

    def counting(self, blobs, *args, **kwargs):
        computed.append(len(blobs))
        return real_batch(self, blobs, *args, **kwargs)

    real_forward = MoEBlock.forward
    with monkeypatch.context() as m:
        m.setattr(ExpertStore, "forward_batch", counting)
        if not trim:
            m.setattr(MoEBlock, "forward", lambda self, x, ctx, last_row_only=False, **kw: real_forward(self, x, ctx, **kw))
        engine = load_engine(folder, cache_slots=slots, knobs=Knobs.from_env({}, **knobs), warmup=False)
        engine.prefill(WARM)
        engine.reset_meters()
        events: list = []
        engine.subscribe(events.append)
        computed.clear()
        logits = engine.prefill(PROMPT)
        n_computed = sum(computed)
        prompt_events = list(events)
        ids = list(engine.continue_from(logits, max_new_tokens=4))
    return engine, prompt_events, logits, ids, n_computed


@pytest.mark.parametrize("source", ["safetensors", "int4"])
@pytest.mark.parametrize("slots", [3, 32])
@pytest.mark.parametrize("knobs", [{}, {"CACHE_ROUTE": "1", "ROUTE_J": "1"}, {"PREFILL_EXACT": "1"}],
                         ids=["stock", "cache_route", "exact"])
def test_last_layer_runs_the_last_tokens_experts_only_and_changes_nothing_seen(folders, source, slots, knobs,
                                                                               monkeypatch):
    trimmed, t_events, t_logits, t_ids, t_n = run(folders[source], slots, knobs, True, monkeypatch)
    full, f_events, f_logits, f_ids, f_n = run(folders[source], slots, knobs, False, monkeypatch)
    assert np.array_equal(t_logits, f_logits)
    assert t_ids == f_ids
    assert routes_of(t_events) == routes_of(f_events)
    assert np.array_equal(trimmed.heat, full.heat)
    ts, fs = trimmed.store_stats(), full.store_stats()
    assert np.array_equal(ts.hits, fs.hits) and np.array_equal(ts.misses, fs.misses)
    assert ts.bytes_read == fs.bytes_read  # every claimed read still lands
    assert trimmed.residency_state() == full.residency_state()
    assert counts_of(trimmed.meter_fold.summary()) == counts_of(full.meter_fold.summary())
    # the last layer computed the last token's experts instead of every expert the prompt used
    last = [e.layers[-1].chosen for e in t_events]
    used = {int(x) for c in last for x in c if x >= 0}
    kept = {int(x) for x in last[-1] if x >= 0}
    assert len(used) > len(kept)
    assert t_n == f_n - len(used) + len(kept)


def test_every_tokens_logits_still_compute_every_expert(folders):
    """With all_logits (teacher-forced NLL, replay) nothing is trimmed: each row's logits are the
    ones the last row gets when it is the prompt's last token."""
    engine = load_engine(folders["int4"], cache_slots=32, knobs=Knobs.from_env({}), warmup=False)
    every = engine.prefill(PROMPT, all_logits=True)
    for n in (len(PROMPT) // 2, len(PROMPT) - 1):
        prefix = engine.prefill(PROMPT[:n], all_logits=True)
        assert np.abs(prefix[-1] - every[n - 1]).max() <= 1e-5 * np.abs(every).max()
