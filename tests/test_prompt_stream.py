"""A prompt's experts through a small RAM cache: grouped per expert and streamed, yet the same
routes, hits, misses and residency as token by token."""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import pytest

from tierlab.engine.expert_store import ExpertStore
from tierlab.engine.kernels.experts_tokens import few_token_limit
from tierlab.engine.knobs import Knobs
from tierlab.engine.model import load_engine
from tierlab.engine.model_files import open_model_files

from prompt_routes import routes_of, shipped_and_int4

WARM = [int(i) for i in np.random.default_rng(11).integers(2, 250, 9)]
PROMPT = [int(i) for i in np.random.default_rng(12).integers(2, 250, 30)]
REL = 1e-4


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return shipped_and_int4(tmp_path_factory.mktemp("stream"))


def run_prompt(folder, slots: int, knobs: dict, grouped: bool):
    """Warm prompt first (slots filled, HOT pins set), then PROMPT in one pass (grouped) or one
    token per pass (each token's experts claimed and computed as decode does)."""
    engine = load_engine(folder, cache_slots=slots, knobs=Knobs.from_env({}, **knobs), warmup=False)
    engine.prefill(WARM)
    engine.reset_meters()
    events: list = []
    engine.subscribe(events.append)
    if grouped:
        logits = engine.prefill(PROMPT, all_logits=True)
    else:
        engine.reset()
        logits = np.stack([engine.forward([t], all_logits=True, phase="prefill")[0] for t in PROMPT])
    return engine, events, logits


@pytest.mark.parametrize("source", ["safetensors", "int4"])
@pytest.mark.parametrize("slots", [2, 12, 32])
@pytest.mark.parametrize("knobs", [{}, {"CACHE_ROUTE": "1", "ROUTE_J": "1"}, {"HOT": "3", "WARMUP": "2"}],
                         ids=["stock", "cache_route", "hot"])
def test_streamed_prompt_decides_what_token_by_token_decides(folders, source, slots, knobs):
    grouped, g_events, g_logits = run_prompt(folders[source], slots, knobs, grouped=True)
    single, s_events, s_logits = run_prompt(folders[source], slots, knobs, grouped=False)
    assert routes_of(g_events) == routes_of(s_events)
    gs, ss = grouped.store_stats(), single.store_stats()
    assert np.array_equal(gs.hits, ss.hits) and np.array_equal(gs.misses, ss.misses)
    if slots < 32:
        assert ss.ram_misses > 0
    assert grouped.residency_state() == single.residency_state()
    if knobs.get("HOT"):
        assert all(grouped.store.pinned(layer) for layer in range(grouped.config.n_layers))
    fold_g, fold_s = grouped.meter_fold.summary(), single.meter_fold.summary()
    for name in ("ram_hits", "ram_misses", "layer_ram_hit", "shadow_hits", "shadow_misses", "swaps", "route_agree"):
        assert fold_g.get(name) == fold_s.get(name), name
    # the KL meter is a function of the router's probabilities: a prompt's and decode's differ in float noise
    assert fold_g.get("route_kl") == pytest.approx(fold_s.get("route_kl"), rel=1e-5)
    # each expert is read at most once per layer: never more bytes than token by token reads
    assert gs.bytes_read <= ss.bytes_read
    assert np.abs(g_logits - s_logits).max() <= REL * np.abs(s_logits).max()
    # and decoding on from there meets the same cache
    token = int(np.argmax(g_logits[-1]))
    grouped.step(token)
    single.step(token)
    assert grouped.residency_state() == single.residency_state()
    assert np.array_equal(grouped.store_stats().hits, single.store_stats().hits)


def token_routes(n_experts: int, top_k: int, tokens: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    hot = rng.permutation(n_experts)[: max(top_k, n_experts // 3)]  # some experts recur, as routers do
    out = []
    for _ in range(tokens):
        pool = hot if rng.random() < 0.7 else np.arange(n_experts)
        out.append([int(e) for e in rng.choice(pool, top_k, replace=False)])
    return out


@pytest.mark.parametrize("source", ["safetensors", "int4"])
@pytest.mark.parametrize("slots", [1, 3, 10])
def test_streamed_experts_are_bit_identical_to_compute(folders, source, slots):
    """The store alone: a prompt streamed with the exact kernel gives every (token, slot) the bits
    `compute` gives it, with the same hits, misses, shadow counts and final slots."""
    files = {name: open_model_files(folders[source]) for name in ("compute", "stream")}
    cfg = files["compute"].config
    E, K, H = cfg.n_experts, cfg.top_k, cfg.hidden_size
    moe = [True] * cfg.n_layers
    stores = {name: ExpertStore(f.source, cfg.n_layers, E, slots, moe, notice=print) for name, f in files.items()}
    rng = np.random.default_rng(slots)
    try:
        for layer in (0, 3):
            for store in stores.values():  # the same slots before the prompt
                for e in (5, 9, 1)[:slots]:
                    store.prefetch(layer, e)
            routes = token_routes(E, K, 24, seed=layer + slots)
            xs = rng.standard_normal((len(routes), H)).astype(np.float32)
            want = np.zeros((len(routes), K, H), dtype=np.float32)
            want_hits, want_shadow = [], []
            timers: dict = defaultdict(float)
            for t, chosen in enumerate(routes):
                ids = np.array(chosen, dtype=np.int32)
                hits, misses, on_gpu, shadow = stores["compute"].compute(layer, ids, xs[t], want[t], timers, stock=ids)
                want_hits.append((hits, misses))
                want_shadow.append(shadow)
                assert on_gpu == []
            store = stores["stream"]
            got = np.zeros_like(want)
            users: dict[int, list[tuple[int, int]]] = {}
            got_hits, got_shadow = [], []
            prompt = store.begin_prompt(layer)
            try:
                for t, chosen in enumerate(routes):
                    hits, shadow = store.claim_prompt_token(prompt, chosen, stock=np.array(chosen, dtype=np.int32))
                    got_hits.append((sum(hits), len(hits) - sum(hits)))
                    got_shadow.append(shadow)
                    for s, e in enumerate(chosen):
                        users.setdefault(e, []).append((t, s))
                ran = []

                def run(expert, blob):
                    ran.append(expert)
                    pairs = users[expert]
                    y = store.forward_tokens(blob, xs[[t for t, _ in pairs]], exact=True)
                    for i, (t, s) in enumerate(pairs):
                        got[t, s] = y[i]

                store.stream_prompt(prompt, list(users), run, timers)
            finally:
                store.end_prompt(prompt)
            assert sorted(ran) == sorted(users)  # each expert ran once
            assert got_hits == want_hits and got_shadow == want_shadow
            assert np.array_equal(got, want)
            assert store.ram_order(layer) == stores["compute"].ram_order(layer)
            assert np.array_equal(store.levels(layer), stores["compute"].levels(layer))
        a, b = stores["stream"].stats(), stores["compute"].stats()
        assert np.array_equal(a.hits, b.hits) and np.array_equal(a.misses, b.misses)
        assert a.bytes_read <= b.bytes_read
        # the slots hold the bytes the bookkeeping says: decode on them gives compute's results
        ids = np.array(token_routes(E, K, 1, seed=99)[0], dtype=np.int32)
        outs = {name: np.zeros((K, H), dtype=np.float32) for name in stores}
        for name, store in stores.items():
            store.compute(0, ids, xs[0], outs[name], defaultdict(float))
        assert np.array_equal(outs["stream"], outs["compute"])
    finally:
        for store in stores.values():
            store.close()


def test_a_failed_run_leaves_no_slot_claiming_bytes_it_lacks(folders):
    """A failure mid-stream (here the caller's run raising) empties the slots whose new expert was
    never read, releases every slot, and the next compute reads what it needs."""
    files = open_model_files(folders["int4"])
    cfg = files.config
    E, K, H = cfg.n_experts, cfg.top_k, cfg.hidden_size
    store = ExpertStore(files.source, cfg.n_layers, E, 6, [True] * cfg.n_layers, notice=print)
    reference = ExpertStore(open_model_files(folders["int4"]).source, cfg.n_layers, E, E,
                            [True] * cfg.n_layers, notice=print)
    try:
        routes = token_routes(E, K, 12, seed=5)
        prompt = store.begin_prompt(0)
        users: list[int] = []
        try:
            for chosen in routes:
                store.claim_prompt_token(prompt, chosen)
                users += [e for e in chosen if e not in users]
            calls = []

            def run(expert, blob):
                calls.append(expert)
                if len(calls) == 3:
                    raise RuntimeError("the caller's run failed")

            with pytest.raises(RuntimeError):
                store.stream_prompt(prompt, users, run, defaultdict(float))
        finally:
            store.end_prompt(prompt)
        x = np.random.default_rng(0).standard_normal(H).astype(np.float32)
        for e in range(E):  # every expert a slot claims gives its own results
            ids = np.array([e], dtype=np.int32)
            got, want = np.zeros((1, H), np.float32), np.zeros((1, H), np.float32)
            store.compute(0, ids, x, got, defaultdict(float))
            reference.compute(0, ids, x, want, defaultdict(float))
            assert np.array_equal(got, want), e
        store.set_slots(3)  # nothing is left busy or loading: a resize does not wait forever
    finally:
        store.close()
        reference.close()


@pytest.mark.parametrize("source", ["safetensors", "int4"])
def test_a_batch_gives_small_experts_decodes_bits_and_the_rest_within_float_noise(folders, source):
    """`forward_batch` on a batch of a layer's slots: an expert of few tokens (the
    one-token kernel's dots) gives each token decode's bits, a wider one (the matrix kernels) within
    1e-5 of them; with `exact` every row is decode's."""
    files = open_model_files(folders[source])
    cfg = files.config
    E, H = cfg.n_experts, cfg.hidden_size
    store = ExpertStore(files.source, cfg.n_layers, E, E, [True] * cfg.n_layers, notice=print)
    try:
        experts = [3, 7, 11, 20]
        for e in experts:
            store.prefetch(0, e)
        # the last expert has more tokens than any kind's few-token limit: the matrix kernels
        x = np.random.default_rng(8).standard_normal((20, H)).astype(np.float32)
        token_rows = [[4], [0, 8], [1, 2, 3, 5, 6], list(range(20))]
        out_rows, at = [], 0
        for rows in token_rows:
            out_rows.append(list(range(at, at + len(rows))))
            at += len(rows)
        wants = []  # decode's results, one token per call
        for e, rows in zip(experts, token_rows):
            want = np.zeros((len(rows), H), dtype=np.float32)
            for i, t in enumerate(rows):
                store.compute(0, np.array([e], dtype=np.int32), x[t], want[i:i + 1], defaultdict(float))
            wants.append(want)
        held = store.acquire(0, experts)
        try:
            blobs = [store.blob(held, i) for i in range(len(experts))]
            for exact in (False, True):
                out = np.full((at, H), np.nan, dtype=np.float32)
                store.forward_batch(blobs, token_rows, x, out, out_rows, exact=exact)
                for want, rows, dest in zip(wants, token_rows, out_rows):
                    if exact or len(rows) <= few_token_limit(files.source.kind, files.source.hidden, files.source.inter):
                        np.testing.assert_array_equal(out[dest], want)
                    else:
                        assert np.abs(out[dest] - want).max() <= 1e-5 * np.abs(want).max()
        finally:
            store.release(held)
    finally:
        store.close()
