"""An attention layer's decode step in one compiled call (`attention_step`) gives the bits
of the layer's calls one by one (`Attention.forward`'s general path): the output and the
KV cache's new entries, with and without the output gate (Qwen3.5/3.6 and Qwen3-MoE), for
every kind of projection weights, over positions that make the cache grow."""

from __future__ import annotations

import copy

import numpy as np
import pytest

from tierlab.engine.models.attention import Attention, KVCache
from tierlab.engine.qlinear import pass_operands
from weight_kinds import KINDS, random_weights

HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 256, 4, 2, 64


class _Config:
    n_heads, n_kv_heads, head_dim, rms_eps, rotary_dim, rope_theta = HEADS, KV_HEADS, HEAD_DIM, 1e-6, 32, 10000.0


def _layer(kind: str, gated: bool, rng: np.random.Generator) -> Attention:
    """An Attention with random weights of one kind, built without a checkpoint."""
    layer = Attention.__new__(Attention)
    layer.cfg = _Config()
    layer.gated = gated
    q_rows = HEADS * HEAD_DIM * (2 if gated else 1)
    layer.w_qkv = random_weights(kind, q_rows + 2 * KV_HEADS * HEAD_DIM, HIDDEN, rng)
    layer.splits = [q_rows, q_rows + KV_HEADS * HEAD_DIM]
    layer.wo = random_weights(kind, HIDDEN, HEADS * HEAD_DIM, rng)
    layer.q_norm = (1.0 + 0.1 * rng.standard_normal(HEAD_DIM)).astype(np.float32)
    layer.k_norm = (1.0 + 0.1 * rng.standard_normal(HEAD_DIM)).astype(np.float32)
    half = _Config.rotary_dim // 2
    layer.inv_freq = (1.0 / (_Config.rope_theta ** (np.arange(0, half, dtype=np.float64) * 2.0 / _Config.rotary_dim))
                      ).astype(np.float32)
    return layer


@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("kind", KINDS)
def test_one_call_gives_the_calls_bits(kind, gated):
    rng = np.random.default_rng(KINDS.index(kind) + 10 * gated)
    layer = _layer(kind, gated, rng)
    layer._step_weights = (pass_operands(layer.w_qkv), pass_operands(layer.wo))
    general = copy.copy(layer)
    general._step_weights = None  # the general path: the calls one by one
    fast, slow = KVCache(KV_HEADS, HEAD_DIM, capacity=4), KVCache(KV_HEADS, HEAD_DIM, capacity=4)
    prompt = rng.standard_normal((3, HIDDEN)).astype(np.float32)
    layer.forward(prompt, 0, fast)
    general.forward(prompt, 0, slow)
    for pos in range(3, 11):  # past the cache's capacity twice
        x = rng.standard_normal((1, HIDDEN)).astype(np.float32)
        got, expected = layer.forward(x, pos, fast), general.forward(x, pos, slow)
        assert got.shape == (1, HIDDEN) and got.tobytes() == expected.tobytes(), pos
        assert fast.k[:, :pos + 1].tobytes() == slow.k[:, :pos + 1].tobytes(), pos
        assert fast.v[:, :pos + 1].tobytes() == slow.v[:, :pos + 1].tobytes(), pos
        assert np.abs(expected).max() > 0


@pytest.mark.parametrize("kind", KINDS)
def test_residual_step_gives_the_layers_calls_bits(kind):
    """`decode_residual`: the input norm, the step, the residual add and the post norm in one
    call give the bits of `Engine._mixer_half`'s general path, and the residual stream's."""
    from tierlab.engine.kernels.dense import rmsnorm

    rng = np.random.default_rng(KINDS.index(kind) + 20)
    layer = _layer(kind, True, rng)
    layer._step_weights = (pass_operands(layer.w_qkv), pass_operands(layer.wo))
    in_norm, post_norm = (1.0 + 0.1 * rng.standard_normal((2, HIDDEN))).astype(np.float32)
    fast, slow = KVCache(KV_HEADS, HEAD_DIM, capacity=2), KVCache(KV_HEADS, HEAD_DIM, capacity=2)
    for pos in range(5):
        x = rng.standard_normal((1, HIDDEN)).astype(np.float32)
        x_ref = x.copy()
        x_ref += layer.forward(rmsnorm(x_ref, in_norm, 1e-6), pos, slow)
        expected = rmsnorm(x_ref, post_norm, 1e-6)
        got = layer.decode_residual(x, pos, fast, (in_norm, post_norm, 1e-6))
        assert got.shape == (1, HIDDEN) and got.tobytes() == expected.tobytes(), pos
        assert x.tobytes() == x_ref.tobytes(), pos
        assert fast.k[:, :pos + 1].tobytes() == slow.k[:, :pos + 1].tobytes(), pos
    layer._step_weights = None
    assert layer.decode_residual(x, 5, fast, (in_norm, post_norm, 1e-6)) is None  # the caller's general path
