"""A decoded token's MoE block in two compiled calls (engine/kernels/moe_step.py) gives the bits
of the block's calls one by one, and leaves the same routing records and the same store.

Two engines over one checkpoint decode the same tokens: one as shipped, one made to take the
general path (`MoEBlock._router_block` None: the router block's launch, the shared expert's step
and the routing as separate calls; `ExpertStore._compute_resident` refused: acquire, one launch
pair, release, the weighted sum from Python). Logits, every routing record and the store's LRU
state must agree after every token, for a bf16 router block (experts int4), a RowStack one
(int8 and int4 dense projections beside the bf16 router), and the shipped bf16 model; with the
stock router, with the meters on (`Router.select` routes), and with the lever on.
"""

from __future__ import annotations

import numpy as np
import pytest

from tierlab import ASSETS_DIR
from tierlab.engine.container import convert
from tierlab.engine.knobs import Knobs
from tierlab.engine.model import load_engine
from tierlab.engine.qlinear import RowStack

MODEL = ASSETS_DIR / "tiny-moe-8x2"
PROMPT = [5, 77, 300, 12, 9, 401, 33, 2]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_step")
    convert(MODEL, root / "int4", bits=4)
    convert(MODEL, root / "int8-d8", bits=8, dense_bits=8)
    convert(MODEL, root / "int4-d4", bits=4, dense_bits=4)
    return {"bf16": MODEL, "int4": root / "int4", "int8-d8": root / "int8-d8", "int4-d4": root / "int4-d4"}


def _general(engine):
    """The engine made to take the block's calls one by one."""
    for layer in engine.layers:
        layer.mlp._router_block = None
    engine.store._compute_resident = lambda *a, **kw: False
    return engine


def _records(routes_by_token) -> list:
    """Every field of the routing records a decoded token publishes."""
    return [(r.layer, r.chosen.tolist(), r.weights.tobytes(), r.true_topk.tolist(), r.level.tolist(), r.ram_hits,
             r.ram_misses, r.shadow_ram_hits, r.shadow_ram_misses) for routes in routes_by_token for r in routes]


def _store_state(engine) -> tuple:
    store = engine.store
    return (store._clock, store.stats().hits.tolist(), store.stats().misses.tolist(),
            [st["last"].tolist() for st in store._layers], [st["busy"].tolist() for st in store._layers])


@pytest.mark.parametrize("name", ["bf16", "int4", "int8-d8", "int4-d4"])
@pytest.mark.parametrize("knobs", [{}, {"ROUTE_AGREE": "1"}, {"CACHE_ROUTE": "1"}])
def test_decode_block_gives_the_calls_bits(models, name, knobs):
    engines = [load_engine(models[name], cache_slots=6, knobs=Knobs.from_env(dict(knobs)), with_tokenizer=False)
               for _ in range(2)]
    fast, general = engines[0], _general(engines[1])
    try:
        mlp = fast.layers[0].mlp
        assert mlp._router_block is not None
        if name.endswith("-d4") or name.endswith("-d8"):
            assert isinstance(mlp.w_in, RowStack)  # the stacked launch
        events = [[], []]
        for e, got in zip(engines, events):
            e.subscribe(got.append)  # a listener: the records carry each expert's residency level
        taken = []
        real = type(fast.store)._compute_resident
        fast.store._compute_resident = lambda *a, **kw: taken.append(1) or real(fast.store, *a, **kw)
        logits = [e.prefill(PROMPT) for e in engines]
        for step in range(12):
            token = int(np.argmax(logits[0]))
            logits = [e.step(token) for e in engines]
            assert logits[0].tobytes() == logits[1].tobytes(), step
            assert _store_state(fast) == _store_state(general), step
        assert taken, "no token took the resident path"
        # the router block ran inside the mixers' calls: its share is booked apart, from the clock
        assert fast.timers["router"] > 0 and fast.timers["deltanet"] > 0 and fast.timers["attention"] > 0
        assert len(events[0]) == len(PROMPT) + 12
        assert _records(e.layers for e in events[0]) == _records(e.layers for e in events[1])
    finally:
        for e in engines:
            e.close()
