"""Group quantisation reference and the numba kernels against float64 references."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from tierlab.engine import blob_layout as L
from tierlab.engine import quant as Q
from tierlab.engine.kernels import qmatvec as K

RTOL = 1e-5


def _close(got, ref, rtol=RTOL):
    """Max error relative to the largest reference value (elementwise relative error is
    meaningless for outputs that happen to be near zero)."""
    got = np.asarray(got, dtype=np.float64)
    scale = max(np.abs(ref).max(), 1e-30)
    err = np.abs(got - ref).max() / scale
    assert err <= rtol, f"relative error {err:.3g} > {rtol}"


@pytest.fixture(scope="module")
def rng():
    return np.random.default_rng(1234)


# --- reference quantiser --------------------------------------------------------------------


def test_int4_pack_unpack_round_trip(rng):
    q = rng.integers(-8, 8, size=(5, 192), dtype=np.int8)
    packed = Q.pack_int4(q)
    assert packed.shape == (5, 96) and packed.dtype == np.uint8
    np.testing.assert_array_equal(Q.unpack_int4(packed), q)


def test_int4_planar_nibble_bytes_are_as_specified():
    q = np.arange(64, dtype=np.int16).reshape(1, 64) % 16 - 8
    q = q.astype(np.int8)
    packed = Q.pack_int4(q)[0]
    for j in range(32):
        assert int(packed[j]) == (int(q[0, j]) + 8) | ((int(q[0, j + 32]) + 8) << 4)


@pytest.mark.parametrize("bits", [4, 8])
def test_quantize_bounds_and_error(rng, bits):
    w = rng.standard_normal((8, 256)) * rng.uniform(0.01, 10, size=(8, 1))
    q, s = Q.quantize(w, bits)
    assert q.dtype == np.int8 and s.dtype == np.float32 and s.shape == (8, 4)
    assert q.min() >= Q.QMIN[bits] and q.max() <= Q.QMAX[bits]
    # every group's largest magnitude maps to +-qmax
    assert (np.abs(q.reshape(8, 4, 64)).max(axis=2) == Q.QMAX[bits]).all()
    err = np.abs(Q.dequantize(q, s) - w).reshape(8, 4, 64).max(axis=2)
    assert (err <= s.astype(np.float64) * 0.5 + 1e-12).all()


@pytest.mark.parametrize("bits", [4, 8])
def test_zero_group_gets_zero_scale(bits):
    w = np.zeros((2, 128))
    w[1, 64:] = np.linspace(-1, 1, 64)
    q, s = Q.quantize(w, bits)
    assert s[0, 0] == 0 and s[0, 1] == 0 and s[1, 0] == 0 and s[1, 1] > 0
    assert not q[0].any() and not q[1, :64].any()


def test_dims_must_be_multiples_of_64():
    with pytest.raises(ValueError, match="multiples of 64"):
        L.check_dims(2048, 500)
    with pytest.raises(ValueError, match="multiple of 64"):
        Q.quantize(np.ones((2, 100)), 4)


def test_blob_layout_sizes():
    lay = L.BlobLayout("int4", 2048, 512)
    assert lay.weight_bytes == 2048 * 512 // 2 and lay.scale_bytes == 2048 * 512 // 64 * 4
    assert lay.nbytes == 3 * (lay.weight_bytes + lay.scale_bytes) and lay.stride % 4096 == 0 and lay.stride >= lay.nbytes
    assert L.BlobLayout("int8", 2048, 512).nbytes == 3 * 2048 * 512 * (1 + 4 / 64)


# --- matvec kernels -------------------------------------------------------------------------

SHAPES = [(64, 64), (96, 320), (512, 2048), (2048, 512)]


def _quant_matvec(q, s, x, bits):
    """The int4 or int8 kernel's dequant(q, s) @ x, into a NaN-filled output."""
    out = np.full(q.shape[0], np.nan, dtype=np.float32)
    if bits == 4:
        K.matvec_int4(Q.pack_int4(q), s, x, out)
    else:
        K.matvec_int8(q, s, x, out)
    return out


@pytest.mark.parametrize("rows,cols", SHAPES)
@pytest.mark.parametrize("bits", [4, 8])
def test_quantised_matvec_matches_float64(rng, rows, cols, bits):
    w = rng.standard_normal((rows, cols))
    q, s = Q.quantize(w, bits)
    x = rng.standard_normal(cols).astype(np.float32)
    _close(_quant_matvec(q, s, x, bits), Q.dequantize(q, s) @ x.astype(np.float64))


@pytest.mark.parametrize("rows,cols", SHAPES + [(7, 45), (9, 200), (3, 8)])
def test_bf16_and_fp32_matvec_match_float64(rng, rows, cols):
    """(7, 45), (9, 200), (3, 8): the row loops take 64 bytes at a time, and the last few
    columns are added after them."""
    w = rng.standard_normal((rows, cols)).astype(np.float32)
    x = rng.standard_normal(cols).astype(np.float32)
    out = np.empty(rows, dtype=np.float32)
    K.matvec_fp32(w, x, out)
    _close(out, w.astype(np.float64) @ x)
    wb = w.astype(ml_dtypes.bfloat16)
    K.matvec_bf16(wb.view(np.uint16), x, out)
    _close(out, wb.astype(np.float64) @ x)


def test_int4_matvec_odd_inputs(rng):
    """Zero groups, a lone extreme group, x with zeros and large values, and -8 nibbles."""
    rows, cols = 64, 256
    w = rng.standard_normal((rows, cols))
    w[3] = 0.0
    w[5, 64:128] = 0.0
    w[7, :64] *= 1e4
    q, s = Q.quantize(w, 4)
    q[9, :] = -8  # the format allows -8 even if the quantiser never emits it
    x = rng.standard_normal(cols).astype(np.float32)
    x[:17] = 0.0
    x[100] = 1e3
    out = np.empty(rows, dtype=np.float32)
    K.matvec_int4(Q.pack_int4(q), s, x, out)
    ref = Q.dequantize(q, s) @ x.astype(np.float64)
    _close(out, ref)
    assert out[3] == 0.0


@pytest.mark.parametrize("bits", [4, 8])
def test_integer_matvec_at_the_extremes_of_weights_and_x(rng, bits):
    """Where the integer sums are largest (every weight at its extreme, every x at its
    group's largest magnitude), x spanning 1e-30..1e4 within a group, and x so small
    (subnormal) that the integer path counts it as zero (groups with all |x| < 2.4e-32)."""
    rows, cols = 6, 192  # three groups: int4 ends on a half block
    qmax, qmin = Q.QMAX[bits], Q.QMIN[bits]
    q = np.empty((rows, cols), np.int8)
    q[0], q[1], q[2] = qmax, qmin, np.where(np.arange(cols) % 2, qmax, qmin)
    q[3:] = rng.integers(qmin, qmax + 1, size=(3, cols))
    s = rng.uniform(0.5, 2.0, size=(rows, cols // 64)).astype(np.float32)
    xs = [np.full(cols, 3.0, np.float32), np.full(cols, -3.0, np.float32),
          np.where(np.arange(cols) % 2, 1e4, -1e-30).astype(np.float32),
          np.full(cols, 1e-40, np.float32)]
    for x in xs:
        ref = Q.dequantize(q, s) @ x.astype(np.float64)
        out = _quant_matvec(q, s, x, bits)
        counted_as_zero = np.abs(Q.dequantize(q, s)).sum(axis=1) * 2.4e-32
        np.testing.assert_array_less(np.abs(out - ref), 1e-5 * np.abs(ref).max() + counted_as_zero)


# --- fused experts --------------------------------------------------------------------------


def _expert(rng, hidden, inter):
    return (rng.standard_normal((inter, hidden)) * 0.05, rng.standard_normal((inter, hidden)) * 0.05,
            rng.standard_normal((hidden, inter)) * 0.05)


@pytest.mark.parametrize("hidden,inter", [(128, 64), (2048, 512)])
@pytest.mark.parametrize("bits", [4, 8])
def test_fused_quantised_expert_matches_float64(rng, hidden, inter, bits):
    gate, up, down = _expert(rng, hidden, inter)
    blob = Q.build_blob(gate, up, down, bits)
    assert blob.nbytes == L.BlobLayout(f"int{bits}", hidden, inter).nbytes
    x = rng.standard_normal(hidden).astype(np.float32)
    y0 = rng.standard_normal(hidden).astype(np.float32)
    y = y0.copy()
    ref = Q.expert_reference(*Q.blob_matrices(blob, bits, hidden, inter), x)
    K.EXPERT_FORWARD[f"int{bits}"](blob, hidden, inter, x, y, 0.375)
    _close(y - y0.astype(np.float64), 0.375 * ref)


@pytest.mark.parametrize("hidden,inter", [(192, 128), (70, 67)])
@pytest.mark.parametrize("kind", ["fp32", "bf16"])
def test_fused_raw_expert_matches_float64(rng, kind, hidden, inter):
    """(70, 67): a gate/up row left over after the two-row steps, and columns past whole lines."""
    mats = _expert(rng, hidden, inter)
    if kind == "fp32":
        typed = [m.astype(np.float32) for m in mats]
        blob = np.concatenate([m.ravel() for m in typed]).view(np.uint8)
    else:
        typed = [m.astype(ml_dtypes.bfloat16) for m in mats]
        blob = np.concatenate([m.ravel().view(np.uint16) for m in typed]).view(np.uint8)
    assert blob.nbytes == L.blob_nbytes(kind, hidden, inter)
    x = rng.standard_normal(hidden).astype(np.float32)
    y = np.zeros(hidden, dtype=np.float32)
    K.EXPERT_FORWARD[kind](blob, hidden, inter, x, y, 1.0)
    _close(y, Q.expert_reference(*[m.astype(np.float64) for m in typed], x))


def test_fused_expert_reads_a_blob_inside_a_larger_slot(rng):
    """RAM slots may be stride-sized: bytes past blob_nbytes must not matter."""
    hidden, inter = 128, 64
    blob = Q.build_blob(*_expert(rng, hidden, inter), 4)
    slot = rng.integers(0, 256, size=L.BlobLayout("int4", hidden, inter).stride + 4096, dtype=np.uint8)
    slot[: blob.nbytes] = blob
    x = rng.standard_normal(hidden).astype(np.float32)
    y1, y2 = np.zeros(hidden, np.float32), np.zeros(hidden, np.float32)
    K.expert_forward_int4(blob, hidden, inter, x, y1, 1.0)
    K.expert_forward_int4(slot, hidden, inter, x, y2, 1.0)
    np.testing.assert_array_equal(y1, y2)


def test_zero_weight_expert_leaves_y_unchanged(rng):
    hidden, inter = 128, 64
    blob = Q.build_blob(np.zeros((inter, hidden)), np.zeros((inter, hidden)), np.zeros((hidden, inter)), 8)
    y = np.arange(hidden, dtype=np.float32)
    K.expert_forward_int8(blob, hidden, inter, rng.standard_normal(hidden).astype(np.float32), y, 1.0)
    np.testing.assert_array_equal(y, np.arange(hidden, dtype=np.float32))


@pytest.mark.parametrize("rows", [3, 65, 66, 67])
@pytest.mark.parametrize("kind", ["fp32", "bf16", "int8", "int4"])
def test_matvec_with_rows_left_over_after_the_four_row_steps(rng, kind, rows):
    """The kernels step four rows at a time; the 1-3 rows left over go one at a time."""
    cols = 128
    w = rng.standard_normal((rows, cols))
    x = rng.standard_normal(cols).astype(np.float32)
    out = np.full(rows, np.nan, dtype=np.float32)
    if kind == "fp32":
        w32 = w.astype(np.float32)
        K.matvec_fp32(w32, x, out)
        ref = w32.astype(np.float64) @ x
    elif kind == "bf16":
        wb = w.astype(ml_dtypes.bfloat16)
        K.matvec_bf16(wb.view(np.uint16), x, out)
        ref = wb.astype(np.float64) @ x
    else:
        bits = int(kind[3:])
        q, s = Q.quantize(w, bits)
        fn = K.matvec_int4 if bits == 4 else K.matvec_int8
        fn(Q.pack_int4(q) if bits == 4 else q, s, x, out)
        ref = Q.dequantize(q, s) @ x.astype(np.float64)
    _close(out, ref)


def test_wrong_shapes_are_refused_before_the_kernel_reads_out_of_bounds(rng):
    q, s = Q.quantize(rng.standard_normal((64, 128)), 4)
    with pytest.raises(ValueError, match="x\\[128\\]"):
        K.matvec_int4(Q.pack_int4(q), s, np.ones(64, np.float32), np.empty(64, np.float32))
    packed, out = Q.pack_int4(q), np.full(64, 7.0, np.float32)
    with pytest.raises(ValueError, match="x\\[128\\]"):  # a 2-D x of the right size
        K.matvec_int4(packed, s, np.ones((1, 128), np.float32), out)
    with pytest.raises(ValueError, match="matvec of a 32x128"):  # rows 32-63 would be read past q's end
        K.matvec_int4(packed[:32], s, np.ones(128, np.float32), out)
    with pytest.raises(ValueError, match="do not describe one C-contiguous matrix"):  # scales' rows 32-63 past their end
        K.matvec_int4(packed, s[:32], np.ones(128, np.float32), out)
    with pytest.raises(ValueError, match="do not describe one C-contiguous matrix"):
        K.matvec_int8(q[:, :64].copy(), s, np.ones(128, np.float32), out)
    with pytest.raises(ValueError, match="C-contiguous"):  # the passes read rows as contiguous bytes
        K.matvec_int8(np.asfortranarray(q), s, np.ones(128, np.float32), out)
    with pytest.raises(ValueError, match="out\\[64\\]"):
        K.matvec_bf16(np.zeros((64, 128), np.uint16), np.ones(128, np.float32), np.empty(32, np.float32))
    assert np.all(out == 7.0)  # a refused call writes nothing
    blob = Q.build_blob(*_expert(rng, 128, 64), 8)
    with pytest.raises(ValueError, match="blob of >="):
        K.expert_forward_int8(blob[:-1], 128, 64, np.ones(128, np.float32), np.zeros(128, np.float32), 1.0)
    with pytest.raises(ValueError, match="float32 y"):
        K.expert_forward_int8(blob, 128, 64, np.ones(128, np.float32), np.zeros(128), 1.0)


def test_kernels_can_run_from_two_threads_at_once(rng):
    """The engine computes on its own thread while another may (GPU tier fallback,
    app): the parallel kernels must be safe to enter concurrently."""
    from concurrent.futures import ThreadPoolExecutor

    q, s = Q.quantize(rng.standard_normal((256, 512)), 4)
    packed = Q.pack_int4(q)
    xs = [rng.standard_normal(512).astype(np.float32) for _ in range(2)]
    refs = [Q.dequantize(q, s) @ x.astype(np.float64) for x in xs]

    def work(i):
        out = np.empty(256, dtype=np.float32)
        for _ in range(50):
            K.matvec_int4(packed, s, xs[i], out)
        return out

    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(work, range(2)))
    for got, ref in zip(results, refs):
        _close(got, ref)


def test_float_path_matches_float64_when_vnni_is_off(tmp_path):
    """Both integer paths are exact: the VNNI integer dot products (the default on
    AVX-512 VNNI hosts) and the widen-to-float path other CPUs use, forced here in a
    fresh process with its own numba cache (the choice is made when the kernels compile)."""
    import os
    import subprocess
    import sys

    code = (
        "import numpy as np\n"
        "from tierlab.engine import quant as Q\n"
        "from tierlab.engine.kernels import qmatvec as K\n"
        "assert K._VNNI is False\n"
        "rng = np.random.default_rng(3)\n"
        "for bits in (4, 8):\n"
        "    for rows, cols in ((512, 2048), (7, 192)):\n"
        "        w = rng.standard_normal((rows, cols)).astype(np.float32)\n"
        "        q, s = Q.quantize(w, bits)\n"
        "        x = rng.standard_normal(cols).astype(np.float32)\n"
        "        out = np.empty(rows, np.float32)\n"
        "        if bits == 4:\n"
        "            K.matvec_int4(Q.pack_int4(q), s, x, out)\n"
        "        else:\n"
        "            K.matvec_int8(q, s, x, out)\n"
        "        ref = Q.dequantize(q, s) @ x.astype(np.float64)\n"
        "        assert np.abs(out - ref).max() <= 1e-5 * np.abs(ref).max(), (bits, rows, cols)\n"
        "print('ok')\n"
    )
    env = dict(os.environ, TIERLAB_VNNI="0", NUMBA_CACHE_DIR=str(tmp_path / "numba"))
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-2000:]
