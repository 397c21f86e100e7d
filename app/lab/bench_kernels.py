"""Kernel benchmark: memory bandwidth and matvec / fused-expert throughput.

Why: the quantised kernels only pay if they run near the memory roofline, so
the benchmark reports each kernel's weights per second next to the stream
bandwidth measured in the same run, right before and after that kernel's
calls (bytes per weight include the scales).
A shared machine is noisy, so every figure is the median of many timed
calls (the best call is reported too); operands rotate through a 512 MiB
working set, larger than the last-level cache (300 MiB on the machine of
docs/benchmarks.md), so that every weight comes from DRAM as it does in
decode, and sit on huge pages as the engine's weights do
(engine/hugepages.py); `per_core_cpu` is the cache-hot figure.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from tierlab.engine import hugepages, threading_layer
from tierlab.engine.blob_layout import GROUP, BlobLayout, blob_nbytes
from tierlab.engine.kernels import qmatvec as K

SHAPES = ((512, 2048), (2048, 512))
KINDS = ("fp32", "bf16", "int8", "int4")
LAYER_EXPERTS = 8  # Qwen3.6-35B-A3B's routed experts per token and layer
BYTES_PER_WEIGHT = {"fp32": 4.0, "bf16": 2.0, "int8": 1.0 + 4.0 / GROUP, "int4": 0.5 + 4.0 / GROUP}


@dataclass
class Timing:
    median_s: float
    best_s: float


@dataclass
class KernelReport:
    threads: int
    bandwidth_gbs: float  # the higher of the two full stream reads, before and after the kernels
    bandwidth_numpy_gbs: float
    working_set_mb: float
    bandwidth_runs_gbs: list[float] = field(default_factory=list)
    # how this machine's int8/int4 kernels compute: "vnni" (integer dot products), "avx2-int4"
    # (int4 by AVX2 integer dot products, int8 widened to float32) or "float" (both widened)
    int_path: str = field(default_factory=lambda: K.INT_PATH)
    matvec: dict[str, float] = field(default_factory=dict)  # median Gweights/s over SHAPES
    matvec_best: dict[str, float] = field(default_factory=dict)
    matvec_by_shape: dict[str, dict[str, float]] = field(default_factory=dict)
    fused_expert: dict[str, float] = field(default_factory=dict)  # Gweights/s of gate+up+down
    # a layer's LAYER_EXPERTS routed experts, Gweights/s: in one launch pair (experts_forward, as the
    # store computes RAM-resident experts) and with one launch pair per expert
    layer_experts: dict[str, float] = field(default_factory=dict)
    layer_experts_each: dict[str, float] = field(default_factory=dict)
    # median over SHAPES of each shape's Gweights/s x bytes/weight / the mean of the stream
    # reads (StreamProbe) right before and right after that shape's calls
    roofline_share: dict[str, float] = field(default_factory=dict)
    shape_bandwidth_gbs: dict[str, dict[str, list[float]]] = field(default_factory=dict)  # [before, after]
    # one thread, Gweights per second of that thread's CPU time (p10 over calls):
    # what a core does when it is not descheduled, robust to a busy shared machine
    per_core_cpu: dict[str, float] = field(default_factory=dict)
    # ContainerExpertSource.read of int4 Qwen3.6-shaped blobs already in the page cache
    expert_read_gbs: float = 0.0
    expert_read_us: float = 0.0

    def to_json(self) -> dict:
        return {
            "threads": self.threads,
            "bandwidth_gbs": self.bandwidth_gbs,
            "bandwidth_numpy_gbs": self.bandwidth_numpy_gbs,
            "bandwidth_runs_gbs": self.bandwidth_runs_gbs,
            "int_path": self.int_path,
            "working_set_mb": self.working_set_mb,
            "matvec": self.matvec,
            "matvec_best": self.matvec_best,
            "matvec_by_shape": self.matvec_by_shape,
            "fused_expert": self.fused_expert,
            "layer_experts": self.layer_experts,
            "layer_experts_each": self.layer_experts_each,
            "roofline_share": self.roofline_share,
            "shape_bandwidth_gbs": self.shape_bandwidth_gbs,
            "per_core_cpu": self.per_core_cpu,
            "expert_read_gbs": self.expert_read_gbs,
            "expert_read_us": self.expert_read_us,
            "bytes_per_weight": BYTES_PER_WEIGHT,
        }


def _time_calls(call, n_calls: int, min_seconds: float) -> Timing:
    """Median and best of single timed calls (after one warm-up call)."""
    call(0)
    times = []
    start = time.perf_counter()
    i = 0
    while i < n_calls or time.perf_counter() - start < min_seconds:
        t0 = time.perf_counter()
        call(i)
        times.append(time.perf_counter() - t0)
        i += 1
        if i >= 50 * n_calls:
            break
    return Timing(float(np.median(times)), float(min(times)))


def _cpu_time_rate(call, weights: int, n_calls: int) -> float:
    """Gweights per second of thread CPU time (10th percentile of calls; 1 numba thread)."""
    call(0)
    times = []
    for i in range(n_calls):
        t0 = time.thread_time_ns()
        call(i)
        dt = time.thread_time_ns() - t0
        if dt > 0:
            times.append(dt)
    return weights / float(np.percentile(times, 10)) if times else 0.0


class StreamProbe:
    """A buffer on huge pages, as the engine's weights are, read by the kernels' own row loop:
    an fp32 matvec over it (64 bytes of four rows per iteration, prefetching ahead, one
    multiply-add per 4 bytes), i.e. the read bandwidth those loops can reach (a plain prange
    sum reads slower: docs/benchmarks.md, Kernels). `read_gbs` is short enough to take right
    before and after a measurement: on a shared VM the stream moves by half from one minute
    to the next, so a share is only meaningful against a reading taken around the same calls."""

    def __init__(self, nbytes: int) -> None:
        self.a = hugepages.empty((max(4, nbytes // 4096), 1024), np.float32)
        self.a[:] = 1.0
        self._ones = np.ones(1024, dtype=np.float32)
        self._out = np.empty(self.a.shape[0], dtype=np.float32)

    def read(self) -> None:
        """One read of the whole buffer, all threads."""
        K.matvec_fp32(self.a, self._ones, self._out)

    def read_gbs(self) -> float:
        """GB/s of the faster of two reads of the buffer."""
        best = float("inf")
        for _ in range(2):
            t0 = time.perf_counter()
            self.read()
            best = min(best, time.perf_counter() - t0)
        return self.a.nbytes / best / 1e9


def measure_bandwidth(nbytes: int, repeats: int, probe: StreamProbe | None = None) -> tuple[float, float]:
    """(2-thread read GB/s by the kernels' row loop, numpy 1-thread sum GB/s), median over
    repeats, of a StreamProbe's buffer (`probe`'s, or a new one of `nbytes`)."""
    probe = probe if probe is not None else StreamProbe(nbytes)
    numba_t = _time_calls(lambda i: probe.read(), repeats, 0.0).median_s
    numpy_t = _time_calls(lambda i: probe.a.sum(), max(2, repeats // 2), 0.0).median_s
    return probe.a.nbytes / numba_t / 1e9, probe.a.nbytes / numpy_t / 1e9


def _random_operands(kind: str, rows: int, cols: int, copies: int, rng: np.random.Generator) -> list[tuple]:
    """`copies` independent weight sets of one kind (contents do not affect speed), each
    part of all copies in one buffer on huge pages, as the engine keeps its weights."""
    if kind == "fp32":
        parts = [((rows, cols), np.float32, lambda: rng.standard_normal((rows, cols), dtype=np.float32))]
    elif kind == "bf16":
        parts = [((rows, cols), np.uint16, lambda: rng.integers(0x3C00, 0x3F80, size=(rows, cols), dtype=np.uint16))]
    else:
        if kind == "int8":
            weights = ((rows, cols), np.int8, lambda: rng.integers(-127, 128, size=(rows, cols), dtype=np.int8))
        else:
            weights = ((rows, cols // 2), np.uint8, lambda: rng.integers(0, 256, size=(rows, cols // 2), dtype=np.uint8))
        parts = [weights, ((rows, cols // GROUP), np.float32, lambda: rng.random((rows, cols // GROUP), dtype=np.float32))]
    arenas = []
    for shape, dtype, draw in parts:
        arena = hugepages.empty((copies,) + shape, dtype)
        for i in range(copies):  # one copy at a time: no second working set in memory
            arena[i] = draw()
        arenas.append(arena)
    return [tuple(arena[i] for arena in arenas) for i in range(copies)]


_MATVEC = {"fp32": K.matvec_fp32, "bf16": K.matvec_bf16, "int8": K.matvec_int8, "int4": K.matvec_int4}


def _copies_for(nbytes_one: int, working_set: int) -> int:
    return int(max(1, min(1024, working_set // max(1, nbytes_one))))


def _fused_blob(kind: str, hidden: int, inter: int, rng: np.random.Generator) -> np.ndarray:
    n = blob_nbytes(kind, hidden, inter)
    blob = rng.integers(0, 256, size=n, dtype=np.uint8)
    if kind in ("int8", "int4"):
        # sane scales so the SiLU sees finite numbers
        scale_start = 3 * hidden * inter * (8 if kind == "int8" else 4) // 8
        blob[scale_start:].view(np.float32)[:] = 1e-3
    elif kind == "bf16":
        blob.view(np.uint16)[:] = 0x3C00
    else:
        blob.view(np.float32)[:] = 1e-3
    return blob


def measure_expert_reads(n_blobs: int, calls: int, hidden: int = 2048, inter: int = 512) -> tuple[float, float]:
    """(GB/s, microseconds per expert) of ContainerExpertSource.read from the page cache.

    Writes a throwaway one-layer int4 container of n_blobs random blobs.
    """
    import json
    import tempfile
    from pathlib import Path

    from tierlab.engine.container import CONTAINER_JSON, EXPERTS_BIN, ContainerExpertSource, ContainerInfo

    layout = BlobLayout("int4", hidden, inter)
    rng = np.random.default_rng(1)
    with tempfile.TemporaryDirectory(prefix="tierlab-bench-") as tmp:
        folder = Path(tmp)
        with open(folder / EXPERTS_BIN, "wb") as f:
            for _ in range(n_blobs):
                f.write(rng.integers(0, 256, size=layout.stride, dtype=np.uint8).tobytes())
        info = ContainerInfo(4, GROUP, 1, n_blobs, hidden, inter, layout.nbytes, layout.stride, [0], "bench", "")
        (folder / CONTAINER_JSON).write_text(json.dumps(info.to_json()))
        with ContainerExpertSource(folder) as src:
            slot = np.empty(layout.stride, dtype=np.uint8)
            for e in range(n_blobs):  # warm the page cache
                src.read(0, e, slot)
            timing = _time_calls(lambda i: src.read(0, i % n_blobs, slot), calls, 0.0)
    return layout.nbytes / timing.median_s / 1e9, timing.median_s * 1e6


def run_kernel_bench(quick: bool = False, threads: int | None = None, progress=None,
                     working_set_mib: int | None = None) -> KernelReport:
    """Measure bandwidth, matvec and fused-expert throughput. quick: a few seconds in total."""
    import numba

    if threads:
        numba.set_num_threads(threads)
    rng = np.random.default_rng(0)
    working_set = (working_set_mib or (16 if quick else 512)) << 20
    calls, min_s = (15, 0.05) if quick else (200, 0.5)
    bw_bytes = (64 if quick else 512) << 20
    # the full stream read before and after the kernels (the report's headline figure); each
    # shape's share is taken against short reads right around its own calls (StreamProbe):
    # on a shared VM the stream moves by half between minutes, and a reading from another
    # minute put every kind at 51-57% in one run and at 75-93% in the next
    probe = StreamProbe(bw_bytes)
    bw, bw_np = measure_bandwidth(bw_bytes, 5 if quick else 15, probe)
    report = KernelReport(numba.get_num_threads(), round(bw, 2), round(bw_np, 2), working_set / 2**20, [round(bw, 2)])
    shares: dict[str, list[float]] = {}

    for kind in KINDS:
        if progress:
            progress(f"matvec {kind}")
        rates, bests = [], []
        report.matvec_by_shape[kind] = {}
        for rows, cols in SHAPES:
            nbytes_one = int(rows * cols * BYTES_PER_WEIGHT[kind])
            ops = _random_operands(kind, rows, cols, _copies_for(nbytes_one, working_set), rng)
            x = rng.standard_normal(cols, dtype=np.float32)
            out = np.empty(rows, dtype=np.float32)
            fn = _MATVEC[kind]
            fn(*ops[0], x, out)  # compiled before the stream read around its calls
            before = probe.read_gbs()
            timing = _time_calls(lambda i: fn(*ops[i % len(ops)], x, out), calls, min_s)
            after = probe.read_gbs()
            rate = rows * cols / timing.median_s / 1e9
            report.shape_bandwidth_gbs.setdefault(kind, {})[f"{rows}x{cols}"] = [round(before, 2), round(after, 2)]
            shares.setdefault(kind, []).append(rate * BYTES_PER_WEIGHT[kind] / (0.5 * (before + after)))
            rates.append(rate)
            bests.append(rows * cols / timing.best_s / 1e9)
            report.matvec_by_shape[kind][f"{rows}x{cols}"] = round(rate, 2)
        report.matvec[kind] = round(float(np.median(rates)), 2)
        report.matvec_best[kind] = round(float(np.median(bests)), 2)
        if not quick:
            threads_before = numba.get_num_threads()
            numba.set_num_threads(1)
            try:
                rows, cols = SHAPES[0]
                ops = _random_operands(kind, rows, cols, 1, rng)
                x = rng.standard_normal(cols, dtype=np.float32)
                out = np.empty(rows, dtype=np.float32)
                fn = _MATVEC[kind]
                report.per_core_cpu[kind] = round(_cpu_time_rate(lambda i: fn(*ops[0], x, out), rows * cols, 300), 2)
            finally:
                numba.set_num_threads(threads_before)

    if progress:
        progress("expert reads")
    read_gbs, read_us = measure_expert_reads(8 if quick else 48, 20 if quick else 200)
    report.expert_read_gbs, report.expert_read_us = round(read_gbs, 2), round(read_us, 1)

    hidden, inter = 2048, 512
    for kind in KINDS:
        if progress:
            progress(f"fused expert {kind}")
        blob_bytes = int(3 * hidden * inter * BYTES_PER_WEIGHT[kind])
        copies = _copies_for(blob_bytes, working_set)
        first = _fused_blob(kind, hidden, inter, rng)
        arena = hugepages.empty((copies, first.nbytes), np.uint8)
        arena[:] = first  # the same weights in every copy: contents do not affect speed
        blobs = list(arena)
        x = rng.standard_normal(hidden, dtype=np.float32) * np.float32(0.1)
        y = np.zeros(hidden, dtype=np.float32)
        fn = K.EXPERT_FORWARD[kind]
        timing = _time_calls(lambda i: fn(blobs[i % len(blobs)], hidden, inter, x, y, 0.5), calls // 2 + 1, min_s)
        report.fused_expert[kind] = round(3 * hidden * inter / timing.median_s / 1e9, 2)
        # a token's experts of one layer: LAYER_EXPERTS different slots of the arena per call
        n = LAYER_EXPERTS
        outs = np.zeros((n, hidden), dtype=np.float32)
        rows = np.arange(n)
        sets = [np.arange(j * n, j * n + n) % copies for j in range(max(1, copies // n))]
        one = _time_calls(lambda i: K.experts_forward(kind, arena, sets[i % len(sets)], hidden, inter, x, outs, rows),
                          calls // 8 + 1, min_s)
        each = _time_calls(lambda i: [fn(arena[s], hidden, inter, x, outs[k], 1.0) for k, s in enumerate(sets[i % len(sets)])],
                           calls // 8 + 1, min_s)
        report.layer_experts[kind] = round(n * 3 * hidden * inter / one.median_s / 1e9, 2)
        report.layer_experts_each[kind] = round(n * 3 * hidden * inter / each.median_s / 1e9, 2)

    if progress:
        progress("bandwidth again")
    bw_after, _ = measure_bandwidth(bw_bytes, 5 if quick else 15, probe)
    report.bandwidth_runs_gbs.append(round(bw_after, 2))
    report.bandwidth_gbs = max(report.bandwidth_runs_gbs)
    for kind, values in shares.items():
        report.roofline_share[kind] = round(float(np.median(values)), 3)
    return report


_INT_PATH_WORDS = {
    "vnni": "integer dot products (AVX-512 VNNI)",
    "avx2-int4": "float32 widening (int8) and AVX2 integer dot products (int4)",
    "float": "float32 widening",
}


def format_report(report: KernelReport) -> str:
    """Plain-text table of a KernelReport."""
    lines = [
        f"threads {report.threads} | stream read {report.bandwidth_gbs:.1f} GB/s (numba; before / after the kernels "
        f"{' / '.join(f'{b:.1f}' for b in report.bandwidth_runs_gbs)}), "
        f"{report.bandwidth_numpy_gbs:.1f} GB/s (numpy, 1 thread) | working set {report.working_set_mb:.0f} MiB",
        f"{'kind':<6}{'B/weight':>10}{'512x2048':>10}{'2048x512':>10}{'median':>9}{'best':>8}{'roofline':>10}{'fused':>8}"
        f"{'layer':>8}{'each':>8}",
    ]
    for kind in KINDS:
        by = report.matvec_by_shape.get(kind, {})
        lines.append(
            f"{kind:<6}{BYTES_PER_WEIGHT[kind]:>10.4f}{by.get('512x2048', 0):>10.2f}{by.get('2048x512', 0):>10.2f}"
            f"{report.matvec.get(kind, 0):>9.2f}{report.matvec_best.get(kind, 0):>8.2f}"
            f"{100 * report.roofline_share.get(kind, 0):>9.0f}%{report.fused_expert.get(kind, 0):>8.2f}"
            f"{report.layer_experts.get(kind, 0):>8.2f}{report.layer_experts_each.get(kind, 0):>8.2f}"
        )
    around = [v for shapes in report.shape_bandwidth_gbs.values() for pair in shapes.values() for v in pair]
    lines.append("Gweights/s (median of timed calls); roofline = Gweights/s x bytes/weight / the stream read right "
                 "before and after that shape's calls (their mean; the median of the two shapes)"
                 + (f", {min(around):.1f}-{max(around):.1f} GB/s" if around else "")
                 + f"; int8/int4 by {_INT_PATH_WORDS.get(report.int_path, report.int_path)}")
    lines.append(f"fused: one 2048x512 expert; layer: {LAYER_EXPERTS} experts in one launch pair (experts_forward), "
                 f"each: the same {LAYER_EXPERTS} with a launch pair per expert")
    if report.expert_read_gbs:
        lines.append(f"expert read (int4 2048x512 blob, page cache): {report.expert_read_us:.0f} us, {report.expert_read_gbs:.1f} GB/s")
    if report.per_core_cpu:
        lines.append("one core, per CPU-second (512x2048, cache-hot): "
                     + ", ".join(f"{k} {v:.1f}" for k, v in report.per_core_cpu.items()))
    lines.append(threading_layer.describe())
    return "\n".join(lines)
