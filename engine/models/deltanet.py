"""Gated DeltaNet, the linear-attention mixer of Qwen3.5/3.6 (30 of 40 layers).

State per layer: the last K-1 inputs of the depthwise causal conv and a
float32 recurrent matrix per value head. Decode walks one token's heads in
parallel; a prompt runs each block of a head's state columns through all its
tokens on one thread (kernels/deltanet_prompt.py; with PREFILL_EXACT the
decode kernel's arithmetic, head by head, bit-identical to decode); the
projections before and after it use matrix-matrix work for a prompt.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tierlab.engine.checkpoint import Checkpoint, fuse_rows
from tierlab.engine.config import ModelConfig
from tierlab.engine.kernels.deltanet_prompt import gated_deltanet_prompt, gated_deltanet_prompt_exact
from tierlab.engine.kernels.deltanet_step import deltanet_step
from tierlab.engine.kernels.dense import gated_deltanet, linear
from tierlab.engine.qlinear import pass_operands


@dataclass
class DeltaNetState:
    """The recurrence folds every token in: it cannot rewind, only come back to a copy."""

    conv: np.ndarray  # [K-1, C]
    recurrent: np.ndarray  # [v_heads, dk, dv]

    rewinds_anywhere = False

    def snapshot(self) -> "DeltaNetState":
        return DeltaNetState(conv=self.conv.copy(), recurrent=self.recurrent.copy())

    def restore(self, saved: "DeltaNetState") -> None:
        np.copyto(self.conv, saved.conv)
        np.copyto(self.recurrent, saved.recurrent)


class GatedDeltaNet:
    def __init__(self, ckpt: Checkpoint, cfg: ModelConfig, layer: int) -> None:
        H = cfg.hidden_size
        kh, vh, dk, dv = cfg.lin_k_heads, cfg.lin_v_heads, cfg.lin_k_dim, cfg.lin_v_dim
        if not (kh and vh and dk and dv) or vh % kh:
            from tierlab.engine.errors import ModelError

            raise ModelError("config.json: linear attention heads/dims missing or value heads not a multiple of key heads",
                             ckpt.dir / "config.json")
        self.cfg = cfg
        p = f"layers.{layer}.linear_attn."
        C = 2 * kh * dk + vh * dv
        self.channels = C
        # the four input projections read the same x: one fused matrix, one pass over it
        self.w_in = fuse_rows([
            ckpt.load(p + "in_proj_qkv.weight", (C, H)),
            ckpt.load(p + "in_proj_z.weight", (vh * dv, H)),
            ckpt.load(p + "in_proj_b.weight", (vh, H)),
            ckpt.load(p + "in_proj_a.weight", (vh, H)),
        ])
        self.splits = (C, C + vh * dv, C + vh * dv + vh)  # where z, b and a start in the fused output
        # the depthwise conv kernel tap by tap, [K, C] (the checkpoint has [C, 1, K]): each tap's
        # weights side by side, so the conv runs across channels in the vector lanes
        conv_w = ckpt.load_f32(p + "conv1d.weight", (C, 1, cfg.conv_kernel)).reshape(C, cfg.conv_kernel)
        self.conv_taps = np.ascontiguousarray(conv_w.T)
        self.a_log = ckpt.load_f32(p + "A_log", (vh,))
        self.dt_bias = ckpt.load_f32(p + "dt_bias", (vh,))
        self.norm_w = ckpt.load_f32(p + "norm.weight", (dv,))
        self.w_out = ckpt.load(p + "out_proj.weight", (H, vh * dv))
        # decode's three kernels in one compiled call, where each projection is one pass
        w_in, w_out = pass_operands(self.w_in), pass_operands(self.w_out)
        self._step_weights = (w_in, w_out) if w_in is not None and w_out is not None else None

    def new_state(self) -> DeltaNetState:
        cfg = self.cfg
        return DeltaNetState(
            conv=np.zeros((max(cfg.conv_kernel - 1, 0), self.channels), dtype=np.float32),
            recurrent=np.zeros((cfg.lin_v_heads, cfg.lin_k_dim, cfg.lin_v_dim), dtype=np.float32),
        )

    def decode_residual(self, x: np.ndarray, start: int, state: DeltaNetState, norms: tuple, router=None,
                        stamps: np.ndarray | None = None) -> np.ndarray | None:
        """One decoded token's half of the layer in one compiled call: x [1, H], the residual
        stream, += forward(input norm(x)) in place; returns the post norm of the new x, with
        norms = (input norm, post norm, eps), and runs the MoE `router` block on it in the
        same call when given (`deltanet_step`). None where the one-call step does not apply."""
        if self._step_weights is None:
            return None
        cfg = self.cfg
        return deltanet_step(*self._step_weights, self.splits, x, state.conv, self.conv_taps, self.a_log,
                             self.dt_bias, self.norm_w, cfg.rms_eps, state.recurrent,
                             (cfg.lin_k_heads, cfg.lin_v_heads, cfg.lin_k_dim, cfg.lin_v_dim), norms, router, stamps)

    def forward(self, x: np.ndarray, start: int, state: DeltaNetState, exact: bool = False) -> np.ndarray:
        """x: normed hidden states [T, H]; `exact`: a prompt gets decode's bits (PREFILL_EXACT)."""
        cfg = self.cfg
        T = x.shape[0]
        if T == 1 and self._step_weights is not None:
            return deltanet_step(*self._step_weights, self.splits, x[0], state.conv, self.conv_taps, self.a_log,
                                 self.dt_bias, self.norm_w, cfg.rms_eps, state.recurrent,
                                 (cfg.lin_k_heads, cfg.lin_v_heads, cfg.lin_k_dim, cfg.lin_v_dim))
        y = linear(self.w_in, x)
        c, zc, bc = self.splits
        mixed, z, b, a = y[:, :c], y[:, c:zc], y[:, zc:bc], y[:, bc:]
        out = np.empty((T, cfg.lin_v_heads * cfg.lin_v_dim), dtype=np.float32)
        if T == 1:
            kernel = gated_deltanet
        else:
            kernel = gated_deltanet_prompt_exact if exact else gated_deltanet_prompt
        kernel(
            np.ascontiguousarray(mixed), state.conv, self.conv_taps, np.ascontiguousarray(z),
            np.ascontiguousarray(b), np.ascontiguousarray(a), self.a_log, self.dt_bias, self.norm_w,
            np.float32(cfg.rms_eps), state.recurrent, cfg.lin_k_heads, cfg.lin_v_heads, cfg.lin_k_dim, cfg.lin_v_dim, out,
        )
        return linear(self.w_out, out)
