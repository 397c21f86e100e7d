"""The prefetch ledger: PILOT's reads, the misses they saved, and how early they finished."""

from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import run_cli
from test_prefetch import run as decode_run
from tierlab import ASSETS_DIR
from tierlab.engine.checkpoint import Checkpoint
from tierlab.engine.config import load_config
from tierlab.engine.expert_source import RawExpertSource
from tierlab.engine.expert_store import ExpertStore

TINY = ASSETS_DIR / "tiny-moe"
LEDGER = ("prefetch_precision", "prefetch_recall", "prefetch_ahead", "prefetch_bytes_per_saved")


def use(store, layer, experts):
    held = store.acquire(layer, experts)
    for i in range(len(experts)):
        store.blob(held, i)
    store.release(held)


def test_the_store_counts_each_read_once_by_hand():
    source = RawExpertSource(Checkpoint(TINY, load_config(TINY)))
    store = ExpertStore(source, 8, 32, 2, [True] * 8, notice=print)
    store.ledger_position(1, 0)
    assert store.prefetch(2, 5, for_pass=1)  # read for pass 1, done while the engine is at layer 0
    store.ledger_position(1, 2)
    use(store, 2, [5, 6])  # pass 1 uses it at layer 2: its own token, 2 layers ahead
    use(store, 2, [5])  # a second hit is an ordinary one
    assert store.prefetch(3, 7, for_pass=1)
    store.ledger_position(2, 3)
    use(store, 3, [7])  # hit by the next pass: a saved miss, not its own token's
    assert store.prefetch(4, 1, for_pass=2)
    use(store, 4, [2, 3])  # evicts the prefetched expert unused
    use(store, 4, [1])  # a miss
    assert store.prefetch(5, 9)  # HOT-style loads stay outside the ledger
    use(store, 5, [9])
    assert not store.prefetch(2, 5, for_pass=2)  # already resident: no read
    ledger = store.prefetch_ledger()
    assert ledger.issued.tolist() == [0, 0, 1, 1, 1, 0, 0, 0]
    assert ledger.hits.tolist() == [0, 0, 1, 1, 0, 0, 0, 0]
    assert ledger.own.tolist() == [0, 0, 1, 0, 0, 0, 0, 0]
    assert ledger.ahead_sum.tolist() == [0, 0, 2, 0, 0, 0, 0, 0]
    assert ledger.blob_nbytes == source.blob_nbytes
    store.reset_counters()
    assert not store.prefetch_ledger().issued.any()
    store.close()


def run(cache, n=24, **knobs):
    """The shipped model's reference prompt, then n greedy steps (test_prefetch's decode loop)."""
    prompt = json.loads((TINY / "ref.json").read_text())["prompt_ids"]
    return decode_run(TINY, cache, prompt, n, **knobs)


@pytest.mark.parametrize("pilot", [1, 2])
def test_the_ledger_of_the_shipped_model_is_consistent(pilot):
    engine, logits = run(6, PILOT=str(pilot))
    m = engine.meters()
    layers = m["prefetch_layers"]
    issued, hits, own = (np.array(layers[k]) for k in ("issued", "hits", "own"))
    assert m["prefetch_issued"] == issued.sum() > 0 and m["prefetch_useful"] == hits.sum() > 0
    assert m["prefetch_own_hits"] == own.sum() and m["prefetch_ahead_sum"] == sum(layers["ahead_sum"])
    assert (own <= hits).all() and (hits <= issued).all()
    assert (hits <= np.array(engine.meter_fold.layer_hits)[: len(hits)]).all()  # each saved miss is a real hit
    for key in ("prefetch_precision", "prefetch_recall"):
        assert 0.0 < m[key] <= 1.0, key
        assert all(v is None or 0.0 <= v <= 1.0 for v in m[key.replace("prefetch_", "prefetch_layer_")])
    assert m["prefetch_precision"] == pytest.approx(own.sum() / issued.sum())
    assert m["prefetch_recall"] == pytest.approx(hits.sum() / (m["ram_misses"] + hits.sum()))
    assert 0.0 <= m["prefetch_ahead"] <= pilot  # a read for layer i+a is queued after layer i's mixer
    assert m["prefetch_bytes_per_saved"] >= 1.0
    assert m["prefetch_bytes"] == m["prefetch_issued"] * engine.store_stats().blob_nbytes
    # the hits prefetch bought are the difference between the two hit rates
    requests = m["ram_hits"] + m["ram_misses"]
    assert (m["ram_hit"] - m["ram_hit_without_prefetch"]) * requests == pytest.approx(m["prefetch_useful"])
    engine.close()
    off, logits_off = run(6)
    assert np.array_equal(logits, logits_off)  # prefetch moves bytes, never results
    off.close()


def test_without_pilot_the_ledger_is_empty():
    engine, _ = run(6, n=4)
    m = engine.meters()
    assert "prefetch_layers" not in m
    for key in LEDGER + ("prefetch_layer_precision", "prefetch_layer_recall", "prefetch_layer_ahead"):
        assert m[key] is None, key
    engine.close()


def test_eval_json_carries_the_ledger():
    proc = run_cli("eval", "--model", str(TINY), "--ref", str(TINY / "ref.json"), "--cache", "6", "--json",
                   env={"PILOT": "1"})
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert 0.0 < out["prefetch_precision"] <= 100.0 and 0.0 < out["prefetch_recall"] <= 100.0  # percent
    assert out["prefetch_bytes_per_saved"] >= 1.0 and 0.0 <= out["prefetch_ahead"] <= 1.0
    assert len(out["prefetch_layer_recall"]) == 8
