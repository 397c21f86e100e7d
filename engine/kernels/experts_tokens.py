"""A prompt's experts of a few tokens each, in two launches: the one-token kernel's dots, batched.

Why: an expert with up to about a dozen tokens is cheaper by the one-token
kernel's dots (`qmatvec._tokens`: integer dot products for int8/int4, each
row read once for all of the expert's tokens) than by the matrix kernels,
which first widen every row to float32 (docs/benchmarks.md, "Few-token
experts"). At the real width (256 experts, top-8) a 128-token prompt gives
most experts 1-10 tokens, and a launch pair per expert was hundreds of
launches a layer. Here one launch computes gate|up for every (expert, chunk
of rows) of a batch, a second one down, the work items dealt as the matrix
kernels deal theirs (`qmatmat._dealt`: each thread takes its share of every
expert, whatever the token counts).

Each token's result is bit for bit what `qmatvec.expert_forward_tokens`
gives it, which is what decode gives it: the same row functions over the
same steps, x prepared by the same function, and nothing summed across
tokens or experts.
"""

from __future__ import annotations

import numba
import numpy as np
from numba import njit, prange

from tierlab.engine.kernels import experts_vnni
from tierlab.engine.kernels.qmatmat import _MARKERS, _deal_plan, _dealt, _expert_matrices, expert_batch
from tierlab.engine.kernels.qmatvec import (_PARALLEL, _STEPS_PER_CHUNK, _WIDE, GATE_UP, INT_PATH, SET, _ahead_bytes,
                                            _columns_left, _first_left_over, _prepare_into, _prepared_sizes,
                                            _rows_dot, _silu_mul, _store4, _store_one, wide_vectors)


#: the most tokens an expert of each kind runs with here rather than by the matrix kernels:
#: where the two cost the same per expert on an AVX-512 VNNI Zen 4 (`tools/prompt_experts_bench.py`,
#: docs/benchmarks.md "Few-token experts"); elsewhere the matrix kernels' earlier threshold
FEW_TOKENS_AVX512 = {"int4": 16, "int8": 12, "bf16": 8, "fp32": 4}
FEW_TOKENS_OTHER = 4
#: int4 / int8 experts whose matrix kernels are `experts_vnni`'s integer dots: those cost what
#: these do at 8 (int4) and 10 (int8) tokens an expert and less above (docs/benchmarks.md, "int4
#: experts by integer dots", "Long prompts: integer tiles for the projections")
FEW_TOKENS_INTEGER_DOTS = {"int4": 8, "int8": 10}


def few_token_limit(kind: str, hidden: int, inter: int) -> int:
    """The most tokens with which a prompt's expert of `kind` (hidden x inter) takes these kernels."""
    if experts_vnni.usable(kind, hidden, inter):
        return FEW_TOKENS_INTEGER_DOTS[kind]
    fast = INT_PATH == "vnni" if kind in ("int8", "int4") else _WIDE
    return FEW_TOKENS_AVX512[kind] if fast else FEW_TOKENS_OTHER


_BITS = {"fp32": 0, "bf16": 0, "int8": 8, "int4": 4}  # as `qmatvec._bits_of` reads the weights' dtype


@njit(**_PARALLEL)
def _prepared(x, bits):
    """Every row of x [n, cols] prepared for the row functions, one row per parallel step."""
    n_digits, n_unit, n_corr = _prepared_sizes(x.shape[1], bits)
    digits = np.empty((x.shape[0], n_digits), np.int8)
    unit = np.empty((x.shape[0], n_unit), np.float32)
    corr = np.empty((x.shape[0], n_corr), np.int32)
    for t in prange(x.shape[0]):
        _prepare_into(x[t], bits, digits[t], unit[t], corr[t])
    return digits, unit, corr


@njit(**_PARALLEL)
def experts_tokens_gate_up(marker, bases, nbytes, hidden, inter, x, digits, unit, corr, tokens, starts, h, threads):
    """h[j] = silu(gate x_t) * (up x_t) with t = tokens[j], for the pairs starts[e] <= j <
    starts[e + 1] of expert e (the blob at address bases[e]); x [T, hidden] prepared as
    (digits, unit, corr) by `_prepared`, h [pairs, inter]."""
    wide_vectors()
    one = np.float32(1.0)
    n_experts = bases.shape[0]
    ahead = _ahead_bytes(_expert_matrices(marker, bases[0], nbytes, hidden, inter)[0], GATE_UP)
    steps = inter // 2
    per = (steps + _STEPS_PER_CHUNK - 1) // _STEPS_PER_CHUNK
    n_items, threads, run, n_steps = _deal_plan(n_experts, per, threads)
    for step in prange(n_steps):
        w = _dealt(step, n_items, threads, run)
        if w >= n_items:
            continue
        e = w // per
        c = w % per
        qg, sg, qu, su, _, _ = _expert_matrices(marker, bases[e], nbytes, hidden, inter)
        for s in range(c * _STEPS_PER_CHUNK, min(steps, (c + 1) * _STEPS_PER_CHUNK)):
            r = 2 * s
            for j in range(starts[e], starts[e + 1]):
                t = tokens[j]
                xt, dt, ut, ct = x[t], digits[t], unit[t], corr[t]
                g0, g1, u0, u1 = _columns_left(
                    qg, qu, r, r + 1, r, r + 1, xt, *_rows_dot(qg, sg, qu, su, r, r + 1, r, r + 1, xt, dt, ut, ct, ahead))
                h[j, r] = _silu_mul(g0, u0)
                h[j, r + 1] = _silu_mul(g1, u1)
    for e in range(n_experts):  # an odd row left over
        qg, sg, qu, su, _, _ = _expert_matrices(marker, bases[e], nbytes, hidden, inter)
        for r in range(_first_left_over(GATE_UP, inter), inter):
            for j in range(starts[e], starts[e + 1]):
                t = tokens[j]
                va, _, vb, _ = _columns_left(qg, qu, r, r, r, r, x[t],
                                             *_rows_dot(qg, sg, qu, su, r, r, r, r, x[t], digits[t], unit[t], corr[t],
                                                        ahead))
                _store_one(GATE_UP, h[j], r, va, vb, one)


@njit(**_PARALLEL)
def experts_tokens_down(marker, bases, nbytes, hidden, inter, h, digits, unit, corr, starts, out, out_rows, threads):
    """out[out_rows[j]] = down h[j] for the pairs starts[e] <= j < starts[e + 1] of expert e;
    h prepared as (digits, unit, corr) by `_prepared`."""
    wide_vectors()
    one = np.float32(1.0)
    n_experts = bases.shape[0]
    ahead = _ahead_bytes(_expert_matrices(marker, bases[0], nbytes, hidden, inter)[4], SET)
    steps = hidden // 4
    per = (steps + _STEPS_PER_CHUNK - 1) // _STEPS_PER_CHUNK
    n_items, threads, run, n_steps = _deal_plan(n_experts, per, threads)
    for step in prange(n_steps):
        w = _dealt(step, n_items, threads, run)
        if w >= n_items:
            continue
        e = w // per
        c = w % per
        _, _, _, _, qd, sd = _expert_matrices(marker, bases[e], nbytes, hidden, inter)
        for s in range(c * _STEPS_PER_CHUNK, min(steps, (c + 1) * _STEPS_PER_CHUNK)):
            r = 4 * s
            for j in range(starts[e], starts[e + 1]):
                hj, dj, uj, cj = h[j], digits[j], unit[j], corr[j]
                v0, v1, v2, v3 = _columns_left(
                    qd, qd, r, r + 1, r + 2, r + 3, hj,
                    *_rows_dot(qd, sd, qd, sd, r, r + 1, r + 2, r + 3, hj, dj, uj, cj, ahead))
                _store4(out[out_rows[j]], r, v0, v1, v2, v3, one, False)
    for e in range(n_experts):  # rows left over past the last group of four
        _, _, _, _, qd, sd = _expert_matrices(marker, bases[e], nbytes, hidden, inter)
        for r in range(_first_left_over(SET, hidden), hidden):
            for j in range(starts[e], starts[e + 1]):
                va, _, vb, _ = _columns_left(qd, qd, r, r, r, r, h[j],
                                             *_rows_dot(qd, sd, qd, sd, r, r, r, r, h[j], digits[j], unit[j], corr[j],
                                                        ahead))
                _store_one(SET, out[out_rows[j]], r, va, vb, one)


def experts_tokens(kind: str, blobs: list, hidden: int, inter: int, x: np.ndarray, token_rows: list,
                   out: np.ndarray, out_rows: list) -> None:
    """out[out_rows[e][i]] = expert e (blobs[e]) of x[token_rows[e][i]] for a batch of a prompt's
    experts, in two parallel launches; each row bit for bit `expert_forward_tokens`'s.
    x [T, hidden], out [rows, hidden] float32 (C order)."""
    if not blobs:
        return
    nbytes, bases, starts, tokens, dest = expert_batch("experts_tokens", kind, blobs, hidden, inter, x, token_rows,
                                                       out, out_rows)
    # only the tokens the batch uses are prepared (a small cache streams a prompt's experts in
    # many batches over the same x), each once however many experts it goes to
    used, local = np.unique(tokens, return_inverse=True)
    xs = np.ascontiguousarray(x[used])
    marker = _MARKERS[kind]
    threads = numba.get_num_threads()
    bits = _BITS[kind]
    h = np.empty((tokens.size, inter), np.float32)
    experts_tokens_gate_up(marker, bases, nbytes, hidden, inter, xs, *_prepared(xs, bits), local.astype(np.int64),
                           starts, h, threads)
    experts_tokens_down(marker, bases, nbytes, hidden, inter, h, *_prepared(h, bits), starts, out, dest, threads)
