"""One launch pair for a layer's routed experts (`qmatvec.experts_forward`) against each expert's own kernel."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tierlab.engine import quant as Q
from tierlab.engine.container import convert
from tierlab.engine.kernels import qmatvec as K
from tierlab.engine.model_files import open_model_files

SHIPPED = Path(__file__).resolve().parents[1] / "assets" / "tiny-moe"


@pytest.fixture(scope="module")
def containers(tmp_path_factory):
    root = tmp_path_factory.mktemp("experts-forward")
    for bits in (4, 8):
        convert(SHIPPED, root / f"int{bits}", bits=bits)
    return {bits: root / f"int{bits}" for bits in (4, 8)}


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


def _check_store(source, layer: int, rng: np.random.Generator) -> None:
    """Fill a RAM store with one layer's experts in shuffled slots; a token's K experts in one
    launch pair must give what each expert's own EXPERT_FORWARD call gives, bit for bit."""
    n_slots = source.n_experts
    store = np.zeros((n_slots, source.blob_nbytes + 64), np.uint8)  # slots longer than one blob, as RAM slots may be
    slot_of = rng.permutation(n_slots)
    for e in range(n_slots):
        source.read(layer, e, store[slot_of[e]])
    for k in (1, 3, 4, 8):
        chosen = rng.choice(n_slots, size=k, replace=False)
        x = rng.standard_normal(source.hidden).astype(np.float32)
        rows = rng.permutation(k + 2)[:k]  # outputs land in any rows of `out`
        expected = rng.standard_normal((k + 2, source.hidden)).astype(np.float32)  # added to, as the store adds
        got = expected.copy()
        for e, r in zip(chosen, rows):
            source.forward(store[slot_of[e]], x, expected[r], 1.0)
        K.experts_forward(source.kind, store, slot_of[chosen], source.hidden, source.inter, x, got, rows)
        assert _same_bits(got, expected), (source.kind, layer, k)


@pytest.mark.parametrize("bits", [4, 8])
def test_container_experts_in_one_launch_match_each_expert(containers, bits):
    rng = np.random.default_rng(bits)
    files = open_model_files(containers[bits])
    try:
        assert files.source.kind == f"int{bits}"
        for layer in (0, files.source.n_layers - 1):
            _check_store(files.source, layer, rng)
    finally:
        files.close()


def test_raw_bf16_experts_in_one_launch_match_each_expert():
    files = open_model_files(SHIPPED)
    try:
        assert files.source.kind == "bf16"
        _check_store(files.source, 0, np.random.default_rng(1))
    finally:
        files.close()


@pytest.mark.parametrize("kind", ["int4", "int8", "bf16", "fp32"])
def test_real_expert_shape_in_one_launch_matches_each_expert(kind):
    """Qwen3.6-35B-A3B's expert shape (2048 x 512): the four-row steps and chunks of the real
    model, with blobs the converter's own functions build."""
    hidden, inter, n = 2048, 512, 4
    rng = np.random.default_rng(5)
    nbytes = K.blob_nbytes(kind, hidden, inter)
    store = np.zeros((n, nbytes), np.uint8)
    for s in range(n):
        gate, up = (rng.standard_normal((inter, hidden)).astype(np.float32) * 0.05 for _ in range(2))
        down = rng.standard_normal((hidden, inter)).astype(np.float32) * 0.05
        if kind in ("int4", "int8"):
            store[s] = Q.build_blob(gate, up, down, 4 if kind == "int4" else 8)
        else:
            flat = np.concatenate([gate.ravel(), up.ravel(), down.ravel()])
            store[s] = (flat.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8) if kind == "bf16" else flat.view(np.uint8)
    x = rng.standard_normal(hidden).astype(np.float32)
    slots = np.array([2, 0, 3])
    expected = np.zeros((3, hidden), np.float32)
    for i, s in enumerate(slots):
        K.EXPERT_FORWARD[kind](store[s], hidden, inter, x, expected[i], 1.0)
    got = np.zeros_like(expected)
    K.experts_forward(kind, store, slots, hidden, inter, x, got, np.arange(3))
    assert np.abs(expected).max() > 0
    assert _same_bits(got, expected)


def test_bad_operands_are_refused():
    store = np.zeros((2, K.blob_nbytes("int4", 128, 64)), np.uint8)
    x = np.zeros(128, np.float32)
    out = np.zeros((2, 128), np.float32)
    with pytest.raises(ValueError, match="experts_forward"):
        K.experts_forward("int4", store, np.array([2]), 128, 64, x, out, np.array([0]))
    with pytest.raises(ValueError, match="experts_forward"):
        K.experts_forward("int4", store, np.array([0]), 128, 64, x, out, np.array([2]))
    with pytest.raises(ValueError, match="experts_forward"):
        K.experts_forward("int4", store[:, :-1], np.array([0]), 128, 64, x, out, np.array([0]))
    with pytest.raises(ValueError, match="distinct out_rows"):
        K.experts_forward("int4", store, np.array([0, 1]), 128, 64, x, out, np.array([1, 1]))
