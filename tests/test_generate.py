"""Generation: greedy equals argmax decoding, sampling is seeded, EOS stops, top-p keeps the nucleus."""

from __future__ import annotations

import numpy as np
import pytest

from tierlab.app.lab.evaluate import greedy_decode
from tierlab.engine.model import load_engine
from tierlab.engine.sampling import Sampler

PROMPT = [5, 9, 17, 33, 65]


def test_greedy_generate_equals_argmax_decode(oracle_models):
    folder = oracle_models["qwen3_moe"][1]
    engine = load_engine(folder)
    ids = list(engine.generate(PROMPT, max_new_tokens=10, eos_ids=[]))
    expected, _ = greedy_decode(load_engine(folder), PROMPT, 10)
    assert ids == expected


def test_sampling_is_seeded(oracle_models):
    folder = oracle_models["qwen3_5_moe"][1]
    engine = load_engine(folder)
    a = list(engine.generate(PROMPT, 12, temperature=1.0, top_p=0.9, seed=3, eos_ids=[]))
    b = list(engine.generate(PROMPT, 12, temperature=1.0, top_p=0.9, seed=3, eos_ids=[]))
    c = list(engine.generate(PROMPT, 12, temperature=1.0, top_p=0.9, seed=4, eos_ids=[]))
    assert a == b and a != c


def test_eos_stops_generation(oracle_models):
    folder = oracle_models["qwen3_moe"][1]
    engine = load_engine(folder)
    first = next(iter(engine.generate(PROMPT, 5, eos_ids=[])))
    assert list(engine.generate(PROMPT, 5, eos_ids=[first])) == [first]


def test_stop_event(oracle_models):
    import threading

    engine = load_engine(oracle_models["qwen3_moe"][1])
    stop = threading.Event()
    out = []
    for token in engine.generate(PROMPT, 50, eos_ids=[], stop_event=stop):
        out.append(token)
        if len(out) == 3:
            stop.set()
    assert len(out) == 3


def test_top_p_keeps_only_the_nucleus():
    logits = np.log(np.array([0.6, 0.3, 0.05, 0.05]))
    sampler = Sampler(temperature=1.0, top_p=0.8, seed=0)
    picks = {sampler.pick(logits) for _ in range(300)}
    assert picks == {0, 1}
    assert Sampler(0.0).pick(logits) == 0
    with pytest.raises(ValueError):
        Sampler(temperature=-1)
