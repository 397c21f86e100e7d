"""Micro-benchmark of the GPU tier's fused expert at real shapes.

    python -m tierlab.app.lab.bench_tier [--hidden 2048 --inter 512 --per-call 8 ...]

Prints the device, then per blob kind: experts/s and the GB/s of weights the
device streams (blob bytes x experts/s), for one token's worth of experts per
call (enqueue + collect, as the engine does). Weights are random but valid
(finite floats, real scales), so the numbers are not helped by zeros.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from tierlab.engine.blob_layout import KINDS, BlobLayout
from tierlab.engine.tiers.opencl_tier import OpenCLTier


def random_blob(layout: BlobLayout, rng: np.random.Generator) -> np.ndarray:
    n = 3 * layout.weights_per_matrix
    if layout.kind == "fp32":
        return (rng.standard_normal(n, dtype=np.float32) * 0.02).view(np.uint8)
    if layout.kind == "bf16":
        w = rng.standard_normal(n, dtype=np.float32) * 0.02
        return (w.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    weights = rng.integers(0, 256, size=3 * layout.weight_bytes, dtype=np.uint8)
    scales = rng.uniform(0.001, 0.01, size=3 * layout.scale_bytes // 4).astype(np.float32)
    return np.concatenate([weights, scales.view(np.uint8)])


def bench_kind(kind: str, args, rng) -> dict | None:
    layout = BlobLayout(kind, args.hidden, args.inter)
    budget_gib = args.resident * (layout.nbytes + 256) / 2**30
    tier = OpenCLTier.open(kind, args.hidden, args.inter, layout.nbytes, budget=budget_gib,
                           device=args.device, notice=lambda s: print(f"  {s}"), row_mode=args.row_mode)
    if tier is None:
        return None
    try:
        if args.show_device:
            print(f"device: {tier.describe()}")
            print(f"{'kind':<5} {'MiB/expert':>10} {'ms/call':>8} {'experts/s':>10} {'GB/s':>7}")
            args.show_device = False
        for e in range(min(args.resident, tier.capacity)):
            tier.upload(0, e, random_blob(layout, rng))
        resident = tier.stats.residents
        x = rng.standard_normal(args.hidden).astype(np.float32)
        calls = [list(rng.choice(resident, size=min(args.per_call, resident), replace=False)) for _ in range(64)]
        for i in range(3):  # warm-up: first launches pay for JIT and page faults
            tier.run(0, calls[i], x)
        times = []
        deadline = time.perf_counter() + args.seconds
        i = 0
        while time.perf_counter() < deadline or len(times) < 5:
            t0 = time.perf_counter()
            tier.run(0, calls[i % len(calls)], x)
            times.append(time.perf_counter() - t0)
            i += 1
        per_call = float(np.median(times))
        experts_s = len(calls[0]) / per_call
        return {
            "kind": kind,
            "ms_call": per_call * 1e3,
            "experts_s": experts_s,
            "gb_s": experts_s * layout.nbytes / 1e9,
            "mib_expert": layout.nbytes / 2**20,
            "calls": len(times),
        }
    finally:
        tier.close()


def _other_row_mode(device: str | None) -> str:
    import os

    import pyopencl as cl

    from tierlab.engine.tiers.opencl_device import NoDevice, pick_device

    try:
        choice = pick_device(cl, device or os.environ.get("TIER_DEVICE") or None)
    except NoDevice:
        return "auto"
    return "group" if choice.is_cpu else "row"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench_tier", description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--inter", type=int, default=512)
    parser.add_argument("--per-call", type=int, default=8, help="experts per enqueue (one token's top-K)")
    parser.add_argument("--resident", type=int, default=64, help="experts uploaded (calls pick among them)")
    parser.add_argument("--seconds", type=float, default=2.0, help="timed seconds per kind")
    parser.add_argument("--kinds", default=",".join(KINDS))
    parser.add_argument("--device", default=None, help="device name substring (default: TIER_DEVICE, else a GPU)")
    parser.add_argument("--row-mode", default="auto", choices=("auto", "row", "group", "other"),
                        help="row strategy; 'other' = the one auto would not pick for this device")
    args = parser.parse_args(argv)
    args.show_device = True
    if args.row_mode == "other":
        args.row_mode = _other_row_mode(args.device)
    rng = np.random.default_rng(0)
    print(f"fused SwiGLU expert, H={args.hidden} I={args.inter}, {args.per_call} experts per call, median of calls")
    ok = False
    for kind in args.kinds.split(","):
        row = bench_kind(kind.strip(), args, rng)
        if row is None:
            print(f"{kind:<5} (no tier)")
            continue
        ok = True
        print(f"{row['kind']:<5} {row['mib_expert']:>10.2f} {row['ms_call']:>8.3f} {row['experts_s']:>10.0f} {row['gb_s']:>7.1f}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
