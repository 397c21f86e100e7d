"""Full (softmax) attention with QK-norm, partial RoPE, GQA and a KV cache.

Shared by both architectures: Qwen3-MoE uses plain norms and no output
gate; Qwen3.5/3.6 uses zero-centred norms and a per-head sigmoid gate that
rides along in q_proj (per head: query(d) | gate(d)).

A prompt's attention runs in tiles of four heads by four keys
(`prompt_attention.attention_tiles`), a decoded token's in three passes over
the cache that read each key and value once (`decode_attention.attention_decode`)
with the tiles' own operations: a token gets the same bits either way, so
PREFILL_EXACT changes nothing here. Head dims that are not a multiple of 16
take the token-by-token kernel `dense.attention` in both.
"""

from __future__ import annotations

import numpy as np

from tierlab.engine.checkpoint import Checkpoint, fuse_rows
from tierlab.engine.config import ModelConfig
from tierlab.engine.kernels.attention_step import attention_step
from tierlab.engine.kernels.decode_attention import attention_decode
from tierlab.engine.kernels.dense import attention, linear, rmsnorm, rope_inplace, sigmoid_gate
from tierlab.engine.kernels.prompt_attention import attention_tiles
from tierlab.engine.kernels.qmatvec import _thread_count
from tierlab.engine.qlinear import pass_operands


class KVCache:
    """Keys and values of one attention layer, grown by doubling.

    Position p's entries depend only on tokens 0..p, so the cache rewinds to any
    prefix by shortening the sequence: a snapshot holds nothing.
    """

    rewinds_anywhere = True

    def __init__(self, n_kv: int, head_dim: int, capacity: int = 256) -> None:
        self.k = np.zeros((n_kv, capacity, head_dim), dtype=np.float32)
        self.v = np.zeros((n_kv, capacity, head_dim), dtype=np.float32)

    def ensure(self, length: int) -> None:
        cap = self.k.shape[1]
        if length <= cap:
            return
        while cap < length:
            cap *= 2
        for name in ("k", "v"):
            old = getattr(self, name)
            new = np.zeros((old.shape[0], cap, old.shape[2]), dtype=np.float32)
            new[:, : old.shape[1]] = old
            setattr(self, name, new)

    def snapshot(self) -> None:
        return None

    def restore(self, saved: None) -> None:
        """Nothing to copy back: the entries before the snapshot's position are unchanged."""


class Attention:
    def __init__(self, ckpt: Checkpoint, cfg: ModelConfig, layer: int) -> None:
        H, nh, nkv, d = cfg.hidden_size, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        p = f"layers.{layer}.self_attn."
        self.cfg = cfg
        self.gated = cfg.attn_output_gate
        q_rows = nh * d * (2 if self.gated else 1)
        # q, k and v read the same x: one fused matrix, one pass over it
        self.w_qkv = fuse_rows([
            ckpt.load(p + "q_proj.weight", (q_rows, H)),
            ckpt.load(p + "k_proj.weight", (nkv * d, H)),
            ckpt.load(p + "v_proj.weight", (nkv * d, H)),
        ])
        self.splits = [q_rows, q_rows + nkv * d]
        self.wo = ckpt.load(p + "o_proj.weight", (H, nh * d))
        # decode's kernels in one compiled call, where each projection is one pass
        w_qkv, w_o = pass_operands(self.w_qkv), pass_operands(self.wo)
        self._step_weights = (w_qkv, w_o) if w_qkv is not None and w_o is not None else None
        self.q_norm = ckpt.load_f32(p + "q_norm.weight", (d,))
        self.k_norm = ckpt.load_f32(p + "k_norm.weight", (d,))
        half = cfg.rotary_dim // 2
        self.inv_freq = (1.0 / (cfg.rope_theta ** (np.arange(0, half, dtype=np.float64) * 2.0 / cfg.rotary_dim))).astype(
            np.float32
        )

    def new_state(self) -> KVCache:
        return KVCache(self.cfg.n_kv_heads, self.cfg.head_dim)

    def decode_residual(self, x: np.ndarray, start: int, cache: KVCache, norms: tuple, router=None,
                        stamps: np.ndarray | None = None) -> np.ndarray | None:
        """One decoded token's half of the layer in one compiled call, as `DeltaNet.decode_residual`:
        x [1, H] += forward(input norm(x)) in place; returns the post norm of the new x."""
        if self._step_weights is None:
            return None
        cfg = self.cfg
        cache.ensure(start + 1)
        return attention_step(*self._step_weights, x, self.gated, (cfg.n_heads, cfg.n_kv_heads, cfg.head_dim),
                              self.q_norm, self.k_norm, cfg.rms_eps, self.inv_freq, cfg.rotary_dim, cache.k, cache.v,
                              start, norms, router, stamps)

    def forward(self, x: np.ndarray, start: int, cache: KVCache, exact: bool = False) -> np.ndarray:
        """x: normed hidden states [T, H] at positions start..start+T-1; `exact` (PREFILL_EXACT) is
        the mixers' common argument: a prompt's attention has decode's bits without it."""
        cfg = self.cfg
        T = x.shape[0]
        nh, nkv, d = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        if T == 1 and self._step_weights is not None:
            cache.ensure(start + 1)
            return attention_step(*self._step_weights, x[0], self.gated, (nh, nkv, d), self.q_norm, self.k_norm,
                                  cfg.rms_eps, self.inv_freq, cfg.rotary_dim, cache.k, cache.v, start)
        y = linear(self.w_qkv, x)
        q_end, k_end = self.splits
        q_all, k, v = y[:, :q_end], y[:, q_end:k_end], y[:, k_end:]
        if self.gated:
            q_all = q_all.reshape(T, nh, 2 * d)
            q = np.ascontiguousarray(q_all[:, :, :d])
            gate = np.ascontiguousarray(q_all[:, :, d:]).reshape(T, nh * d)
        else:
            q = np.ascontiguousarray(q_all).reshape(T, nh, d)
            gate = None
        k = np.ascontiguousarray(k).reshape(T, nkv, d)
        v = np.ascontiguousarray(v).reshape(T, nkv, d)
        q = rmsnorm(q, self.q_norm, cfg.rms_eps)
        k = rmsnorm(k, self.k_norm, cfg.rms_eps)
        positions = np.arange(start, start + T, dtype=np.int64)
        rope_inplace(q, positions, self.inv_freq, cfg.rotary_dim)
        rope_inplace(k, positions, self.inv_freq, cfg.rotary_dim)
        cache.ensure(start + T)
        cache.k[:, start:start + T] = k.transpose(1, 0, 2)
        cache.v[:, start:start + T] = v.transpose(1, 0, 2)
        out = np.empty((T, nh, d), dtype=np.float32)
        if d % 16:
            attention(q, cache.k, cache.v, start, out)
        elif T == 1:
            attention_decode(q[0], cache.k, cache.v, start, out[0], _thread_count())
        else:
            attention_tiles(q, cache.k, cache.v, start, out)
        out = out.reshape(T, nh * d)
        if gate is not None:
            sigmoid_gate(out, gate)
        return linear(self.wo, out)
