"""One Gated DeltaNet layer's decode step in one compiled call: in_proj, the recurrence, out_proj.

Why: in decode these were three calls from Python, and the Python between them
(slicing in_proj's output, the recurrence's sixteen arguments, out_proj's checks)
cost about 60 us a layer, mostly cache misses on the interpreter's state after
in_proj's megabytes of weights had streamed through the caches
(docs/benchmarks.md, "What a call costs right after a streaming one"). Here the
same three kernels run from compiled code on the same operands, so a step's
bits are those of the three calls (tests/test_deltanet_step.py).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from tierlab.engine.kernels.dense import add_rms_norm, gated_deltanet, residual_norms, rms_norm
from tierlab.engine.kernels.moe_step import timed_router_block
from tierlab.engine.kernels.qmatvec import SET, _pass, _thread_count


@njit(nogil=True, cache=True)
def _deltanet_kernels(wi, si, wo, so, x2, conv, taps, a_log, dt_bias, norm_w, eps, recurrent, kh, vh, dk, dv,
                      c, zc, bc, threads, y, core, out, residual, in_norm, post_norm, layer_eps, xn, h_post):
    if residual:  # x2 is the residual stream: its input norm first
        rms_norm(x2, in_norm, layer_eps, xn)
        x = xn[0]
    else:
        x = x2[0]
    _pass(wi, si, wi, si, x, y, SET, 1.0, threads)
    gated_deltanet(y[:c].reshape((1, c)), conv, taps, y[c:zc].reshape((1, zc - c)),
                   y[zc:bc].reshape((1, bc - zc)), y[bc:].reshape((1, y.shape[0] - bc)),
                   a_log, dt_bias, norm_w, eps, recurrent, kh, vh, dk, dv, core.reshape((1, core.shape[0])))
    _pass(wo, so, wo, so, core, out[0], SET, 1.0, threads)
    if residual:
        add_rms_norm(x2, out, post_norm, layer_eps, h_post)


@njit(nogil=True, cache=True)
def _deltanet_then_router(layer_args, router_args, stamps):
    """The step (with its norms), then the MoE router block on its post norm, timed."""
    _deltanet_kernels(*layer_args)
    timed_router_block(router_args, stamps)


def deltanet_step(w_in: tuple, w_out: tuple, splits: tuple[int, int, int], x: np.ndarray, conv: np.ndarray,
                  taps: np.ndarray, a_log: np.ndarray, dt_bias: np.ndarray, norm_w: np.ndarray, eps: float,
                  recurrent: np.ndarray, heads: tuple[int, int, int, int], norms: tuple | None = None,
                  router=None, stamps: np.ndarray | None = None) -> np.ndarray:
    """out_proj(recurrence(in_proj(x))) for one token x float32[H]: float32[1, H], with
    w_in, w_out from `qlinear.pass_operands`, the fused in_proj's `splits` (where z, b and a
    start) and heads = (key heads, value heads, key dim, value dim); the conv and
    recurrent states are updated in place, as `gated_deltanet` updates them.

    With norms = (input norm, post norm, eps), x is the layer's residual stream
    float32[1, H] instead: its input norm runs first, the output is added to x in place,
    and the result is the post norm of the new x (`dense.residual_norms`). With a `router`
    as well (`moe_step.RouterCall`), the post norm goes into router.x and the router block
    runs on it in the same call; stamps int64[2] gets the clock at its start and end."""
    kh, vh, dk, dv = heads
    (wi, si), (wo, so) = w_in, w_out
    y = np.empty(wi.shape[0], dtype=np.float32)
    core = np.empty(vh * dv, dtype=np.float32)
    out = np.empty((1, wo.shape[0]), dtype=np.float32)
    c, zc, bc = splits
    residual, in_norm, post_norm, layer_eps, xn, h_post, x2 = residual_norms(norms, x,
                                                                           None if router is None else router.x)
    args = (wi, si, wo, so, x2, conv, taps, a_log, dt_bias, norm_w, np.float32(eps), recurrent, kh, vh, dk, dv, c, zc,
            bc, _thread_count(), y, core, out, residual, in_norm, post_norm, layer_eps, xn, h_post)
    if router is None:
        _deltanet_kernels(*args)
    else:
        _deltanet_then_router(args, router.args, stamps)
    return h_post if residual else out
