"""The GPU expert tier against a float64 numpy reference, on whatever OpenCL device is here.

CI has only PoCL (a CPU device); bench/gpu_tier.sh runs the same tests on a
real GPU with TIER_DEVICE set. Blob builders below are written from the
layout description, independently of the tier's code.
"""

from __future__ import annotations

import numpy as np
import pytest

import pyopencl as cl

from tierlab.engine.blob_layout import KINDS, blob_nbytes
from tierlab.engine.tiers.opencl_tier import OpenCLTier, TierFailure

SMALL = (128, 64)
BIGGER = (384, 192)


pytestmark = pytest.mark.usefixtures("opencl_device")


# --- blob builders (test-side, from the layout spec) ----------------------


def _quantise(w: np.ndarray, qmax: int, rng) -> tuple[np.ndarray, np.ndarray]:
    rows, cols = w.shape
    q = rng.integers(-qmax - 1 if qmax == 7 else -qmax, qmax + 1, size=(rows, cols)).astype(np.int8)
    scales = rng.uniform(0.005, 0.05, size=(rows, cols // 64)).astype(np.float32)
    return q, scales


def _pack_int4(q: np.ndarray) -> np.ndarray:
    rows, cols = q.shape
    g = (q.astype(np.int16) + 8).astype(np.uint8).reshape(rows, cols // 64, 64)
    return (g[..., :32] | (g[..., 32:] << 4)).astype(np.uint8).reshape(-1)


def make_expert(kind: str, hidden: int, inter: int, rng) -> tuple[np.ndarray, list[np.ndarray]]:
    """(blob, [gate, up, down] as the float64 weights the blob stands for)."""
    shapes = [(inter, hidden), (inter, hidden), (hidden, inter)]
    if kind in ("fp32", "bf16"):
        mats = [rng.standard_normal(s).astype(np.float32) * 0.1 for s in shapes]
        if kind == "fp32":
            blob = np.concatenate([m.reshape(-1) for m in mats]).astype("<f4").view(np.uint8)
            return blob, [m.astype(np.float64) for m in mats]
        bits = [(m.view(np.uint32) >> 16).astype(np.uint16) for m in mats]
        blob = np.concatenate([b.reshape(-1) for b in bits]).astype("<u2").view(np.uint8)
        return blob, [(b.astype(np.uint32) << 16).view(np.float32).astype(np.float64) for b in bits]
    qmax = 127 if kind == "int8" else 7
    qs, scales = zip(*(_quantise(np.empty(s), qmax, rng) for s in shapes))
    if kind == "int8":
        weights = np.concatenate([q.reshape(-1) for q in qs]).view(np.uint8)
    else:
        weights = np.concatenate([_pack_int4(q) for q in qs])
    blob = np.concatenate([weights, np.concatenate([s.reshape(-1) for s in scales]).astype("<f4").view(np.uint8)])
    deq = [q.astype(np.float64) * np.repeat(s.astype(np.float64), 64, axis=1) for q, s in zip(qs, scales)]
    return blob, deq


def reference(mats: list[np.ndarray], x: np.ndarray) -> np.ndarray:
    gate, up, down = mats
    x = x.astype(np.float64)
    g = gate @ x
    return down @ (g / (1.0 + np.exp(-g)) * (up @ x))


def open_tier(kind, hidden, inter, notes=None, **kw):
    notes = [] if notes is None else notes
    kw.setdefault("budget", 0.05)
    tier = OpenCLTier.open(kind, hidden, inter, blob_nbytes(kind, hidden, inter), notice=notes.append, **kw)
    return tier, notes


def rel_err(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


# --- numerics --------------------------------------------------------------


@pytest.mark.parametrize("row_mode", ["auto", "group"])
@pytest.mark.parametrize("shape", [SMALL, BIGGER], ids=["128x64", "384x192"])
@pytest.mark.parametrize("kind", KINDS)
def test_matches_float64_reference(kind, shape, row_mode):
    hidden, inter = shape
    rng = np.random.default_rng([KINDS.index(kind), *shape])  # not hash(): it is salted per process
    tier, notes = open_tier(kind, hidden, inter, row_mode=row_mode)
    assert tier is not None, notes
    experts = {}
    for layer, expert in [(0, 3), (0, 1), (1, 3), (0, 7)]:
        blob, mats = make_expert(kind, hidden, inter, rng)
        assert tier.upload(layer, expert, blob)
        experts[(layer, expert)] = mats
    x = rng.standard_normal(hidden).astype(np.float32)
    # Several experts of one layer in one call, in a non-sorted order, then a single one.
    out = tier.collect(tier.enqueue(0, [7, 3, 1], x))
    assert out.shape == (3, hidden) and out.dtype == np.float32
    for row, e in enumerate([7, 3, 1]):
        assert rel_err(out[row], reference(experts[(0, e)], x)) < 1e-5
    single = tier.run(1, [3], x)
    assert rel_err(single[0], reference(experts[(1, 3)], x)) < 1e-5
    tier.close()


def test_experts_spread_over_several_pools_come_back_in_call_order():
    hidden, inter = SMALL
    rng = np.random.default_rng(7)
    tier, notes = open_tier("int4", hidden, inter)
    tier.slots_per_pool = 2  # before any upload: forces four pools for eight experts
    mats = {}
    for e in range(8):
        blob, mats[e] = make_expert("int4", hidden, inter, rng)
        assert tier.upload(2, e, blob)
    assert len(tier._pools) == 4
    x = rng.standard_normal(hidden).astype(np.float32)
    order = [6, 0, 5, 2, 7]
    out = tier.run(2, order, x)
    for row, e in enumerate(order):
        assert rel_err(out[row], reference(mats[e], x)) < 1e-5
    tier.close()


def test_handles_overlap_and_x_may_be_reused_right_away():
    hidden, inter = SMALL
    rng = np.random.default_rng(11)
    tier, _ = open_tier("bf16", hidden, inter)
    blob, mats = make_expert("bf16", hidden, inter, rng)
    tier.upload(0, 0, blob)
    x = rng.standard_normal(hidden).astype(np.float32)
    want = reference(mats, x)
    handles = []
    for _ in range(6):  # more than the scratch ring
        handles.append(tier.enqueue(0, [0], x))
    x[:] = 0.0
    for h in handles:
        assert rel_err(tier.collect(h)[0], want) < 1e-5
    assert tier.collect(tier.enqueue(0, [], x)).shape == (0, hidden)
    assert tier.stats.enqueues == 6 and tier.stats.experts_run == 6
    tier.close()


# --- residency and budget --------------------------------------------------


def test_upload_residency_mask_capacity_and_stats():
    hidden, inter = SMALL
    kind = "int8"
    nbytes = blob_nbytes(kind, hidden, inter)
    rng = np.random.default_rng(3)
    stride = -(-nbytes // 256) * 256
    budget_gib = 3.5 * stride / 2**30  # room for 3 slots, not 4
    tier, notes = open_tier(kind, hidden, inter, budget=budget_gib)
    assert tier.capacity == 3
    blobs = [make_expert(kind, hidden, inter, rng)[0] for _ in range(4)]
    assert tier.upload(5, 2, blobs[0]) and tier.upload(5, 0, blobs[1]) and tier.upload(4, 2, blobs[2])
    assert tier.is_resident(5, 2) and tier.is_resident(4, 2) and not tier.is_resident(4, 0)
    assert tier.resident_mask(5, 4).tolist() == [True, False, True, False]
    assert tier.stats.uploads == 3 and tier.stats.bytes == 3 * nbytes and tier.stats.residents == 3
    assert notes == []
    # Past capacity: False and a single notice, however often it is tried.
    assert tier.upload(6, 0, blobs[3]) is False
    assert tier.upload(6, 1, blobs[3]) is False
    assert len(notes) == 1 and "full" in notes[0]
    # Re-uploading a resident expert reuses its slot; evicting frees one.
    assert tier.upload(5, 2, blobs[3])
    assert tier.evict(5, 0) and not tier.is_resident(5, 0)
    assert tier.upload(6, 0, blobs[3]) and tier.stats.residents == 3
    with pytest.raises(ValueError):
        tier.upload(7, 0, blobs[3][:-1])
    with pytest.raises(ValueError):
        tier.enqueue(5, [0], np.zeros(hidden, np.float32))
    tier.close()


def test_budget_larger_than_device_is_clamped_with_one_notice():
    tier, notes = open_tier("fp32", *SMALL, budget=1e6)
    assert tier is not None
    assert len(notes) == 1 and "clamped" in notes[0]
    assert tier.budget_bytes < 1e6 * 2**30
    assert tier.capacity == tier.budget_bytes // tier.slot_stride
    tier.close()


def test_auto_budget_is_bounded_on_a_cpu_device():
    tier, notes = open_tier("int4", *SMALL, budget="auto")
    assert tier is not None and notes == []
    if tier.is_cpu_device:
        assert tier.budget_bytes <= 4 * 2**30
    tier.close()


def test_bad_budget_is_a_caller_error():
    with pytest.raises(ValueError):
        open_tier("fp32", *SMALL, budget="lots")
    with pytest.raises(ValueError):
        open_tier("fp32", *SMALL, budget=-1)


def test_budget_smaller_than_one_expert_gives_none():
    tier, notes = open_tier("fp32", *SMALL, budget=1e-6)
    assert tier is None and len(notes) == 1


# --- failures ---------------------------------------------------------------


def test_unknown_device_name_gives_none_and_one_notice():
    tier, notes = open_tier("fp32", *SMALL, device="no-such-device-xyz")
    assert tier is None
    assert len(notes) == 1 and "no-such-device-xyz" in notes[0]


def test_tier_device_environment_is_read_when_no_name_is_given(monkeypatch):
    monkeypatch.setenv("TIER_DEVICE", "no-such-device-xyz")
    tier, notes = open_tier("fp32", *SMALL)
    assert tier is None and len(notes) == 1


def test_no_opencl_platform_gives_none_and_one_notice(monkeypatch):
    def no_platform():
        raise cl.LogicError("clGetPlatformIDs failed: PLATFORM_NOT_FOUND_KHR")

    monkeypatch.setattr(cl, "get_platforms", no_platform)
    tier, notes = open_tier("fp32", *SMALL)
    assert tier is None
    assert len(notes) == 1 and "no OpenCL platform" in notes[0]


def test_kernel_build_failure_gives_none_and_one_notice():
    tier, notes = open_tier("int4", *SMALL, kernel_source="__kernel void gate_up( { this is not OpenCL C")
    assert tier is None
    assert len(notes) == 1 and "failed to build" in notes[0]


def test_device_failure_mid_run_disables_the_tier(monkeypatch):
    hidden, inter = SMALL
    rng = np.random.default_rng(5)
    tier, notes = open_tier("fp32", hidden, inter)
    blob, _ = make_expert("fp32", hidden, inter, rng)
    assert tier.upload(0, 1, blob)

    def lost(*args, **kwargs):
        raise cl.RuntimeError("clEnqueueNDRangeKernel failed: DEVICE_NOT_AVAILABLE")

    monkeypatch.setattr(tier, "_launch", lost)
    x = np.ones(hidden, np.float32)
    with pytest.raises(TierFailure):
        tier.enqueue(0, [1], x)
    assert len(notes) == 1 and "DEVICE_NOT_AVAILABLE" in notes[0]
    # Afterwards: nothing resident, enqueue fails fast, upload says no, no more notices.
    assert not tier.is_resident(0, 1) and not tier.resident_mask(0, 4).any()
    with pytest.raises(TierFailure):
        tier.enqueue(0, [], x)
    assert tier.upload(0, 2, blob) is False
    assert len(notes) == 1
    tier.close()


def test_blob_size_mismatch_is_rejected_at_open():
    with pytest.raises(ValueError):
        OpenCLTier.open("int4", 128, 64, 12345, notice=lambda s: None)
    with pytest.raises(ValueError):
        OpenCLTier.open("int4", 100, 64, 1, notice=lambda s: None)  # not a multiple of the group


@pytest.mark.parametrize("bits", [8, 4])
def test_agrees_with_the_container_quantiser(bits):
    """Blobs written by the container's quantiser (engine/quant.py, written independently) run as they are."""
    from tierlab.engine import quant
    hidden, inter = SMALL
    rng = np.random.default_rng(bits)
    gate, up = (rng.standard_normal((inter, hidden)) * 0.1 for _ in range(2))
    down = rng.standard_normal((hidden, inter)) * 0.1
    blob = quant.build_blob(gate, up, down, bits)
    kind = f"int{bits}"
    tier, notes = open_tier(kind, hidden, inter)
    assert tier.upload(0, 0, blob), notes
    x = rng.standard_normal(hidden).astype(np.float32)
    want = quant.expert_reference(*quant.blob_matrices(blob, bits, hidden, inter), x)
    assert rel_err(tier.run(0, [0], x)[0], want) < 1e-5
    tier.close()


def test_warmstart_fills_the_tier_in_heat_order_then_stops_when_full(tmp_path):
    from tierlab.engine.errors import FormatError
    from tierlab.engine.heat import HeatProfile
    from tierlab.engine.tiers.warmstart import warmstart

    hidden, inter = SMALL
    kind = "int4"
    stride = -(-blob_nbytes(kind, hidden, inter) // 256) * 256
    rng = np.random.default_rng(9)
    blobs = {(l, e): make_expert(kind, hidden, inter, rng) for l in range(3) for e in range(4)}

    def read_into(layer, expert, out):
        out[:] = blobs[(layer, expert)][0]

    heat = HeatProfile(3, 4)
    heat.counts[:] = [[0, 0, 0, 0], [1, 9, 0, 3], [5, 0, 0, 2]]
    heat.write(tmp_path / "heat.bin")
    tier, notes = open_tier(kind, hidden, inter, budget=3.5 * stride / 2**30)
    report = warmstart(tier, read_into, 3, 4, heat_file=str(tmp_path / "heat.bin"))
    assert (report.order, report.planned, report.uploaded) == ("heat", 3, 3)
    assert tier.residents() == [(1, 1), (1, 3), (2, 0)]
    x = rng.standard_normal(hidden).astype(np.float32)
    assert rel_err(tier.run(2, [0], x)[0], reference(blobs[(2, 0)][1], x)) < 1e-5
    tier.close()

    tier, notes = open_tier(kind, hidden, inter, budget=3.5 * stride / 2**30)
    report = warmstart(tier, read_into, 3, 4, moe_layers=[False, True, True])
    assert report.order == "index" and tier.residents() == [(1, 0), (1, 1), (1, 2)]
    with pytest.raises(FormatError):
        warmstart(tier, read_into, 3, 5, heat_file=str(tmp_path / "heat.bin"))
    tier.close()


def test_device_failure_while_collecting_disables_the_tier():
    hidden, inter = SMALL
    rng = np.random.default_rng(12)
    tier, notes = open_tier("bf16", hidden, inter)
    blob, _ = make_expert("bf16", hidden, inter, rng)
    tier.upload(3, 0, blob)
    handle = tier.enqueue(3, [0], np.ones(hidden, np.float32))
    handle.done.wait()

    class LostEvent:
        def wait(self):
            raise cl.RuntimeError("clWaitForEvents failed: EXEC_STATUS_ERROR_FOR_EVENTS_IN_WAIT_LIST")

    handle.done = LostEvent()
    with pytest.raises(TierFailure):
        tier.collect(handle)
    assert len(notes) == 1 and not tier.is_resident(3, 0) and tier.stats.residents == 0
    tier.close()


def test_out_of_device_memory_while_uploading_shrinks_capacity(monkeypatch):
    hidden, inter = SMALL
    rng = np.random.default_rng(13)
    tier, notes = open_tier("int8", hidden, inter)
    tier.slots_per_pool = 2
    blob, mats = make_expert("int8", hidden, inter, rng)
    assert tier.upload(0, 0, blob) and tier.upload(0, 1, blob)  # fills pool 0
    real_pool_offset = tier._pool_offset

    def no_memory(slot):
        if slot >= 2:
            raise cl.MemoryError("clCreateBuffer failed: MEM_OBJECT_ALLOCATION_FAILURE")
        return real_pool_offset(slot)

    monkeypatch.setattr(tier, "_pool_offset", no_memory)
    assert tier.upload(0, 2, blob) is False
    assert tier.upload(0, 3, blob) is False
    assert len(notes) == 1 and "out of memory" in notes[0]
    assert tier.capacity == 2 and tier.failed is None
    x = rng.standard_normal(hidden).astype(np.float32)
    assert rel_err(tier.run(0, [1], x)[0], reference(mats, x)) < 1e-5  # what it holds still works
    tier.close()
