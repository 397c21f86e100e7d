"""What the per-blob checksums cost: first reads, the hash itself, and decode, interleaved.

Usage: python tools/checksum_cost.py CONTAINER [--rounds 3] [--cache 8]

CONTAINER is a version 2 container (written by `tierlab convert`). A copy of
it without checksums (version 1: nothing is verified) is made in a temporary
folder next to it, the experts.bin hard-linked (same bytes, same page cache).
Reported: microseconds per blob of a first read (pread + hash) and of a
re-read (pread only) for both, the hash alone, the load time of both
(`load_engine` without tokenizer or warm-up, least CPU time of 25), and
`tierlab bench decode --cache N` decode tok/s of the two interleaved,
`--rounds` times (0: no decode runs).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from tierlab.engine.container import (
    CHECKSUM_FILE, CONTAINER_JSON, EXPERTS_BIN, ContainerExpertSource, blob_hash, read_container_info,
)


def without_checksums(container: Path, into: Path) -> Path:
    """A version 1 twin of the container: same files, no experts.xxh, no checksums in the manifest."""
    twin = into / "v1"
    shutil.copytree(container, twin, ignore=shutil.ignore_patterns(EXPERTS_BIN, CHECKSUM_FILE))
    os.link(container / EXPERTS_BIN, twin / EXPERTS_BIN)
    meta = json.loads((container / CONTAINER_JSON).read_text())
    meta.pop("checksums")
    meta["version"] = 1
    (twin / CONTAINER_JSON).write_text(json.dumps(meta))
    return twin


def read_pass_us(folder: Path) -> tuple[float, float]:
    """(first read, re-read) in microseconds per blob, every blob of the container, page cache warm."""
    info = read_container_info(folder)
    slot = np.empty(info.blob_nbytes, dtype=np.uint8)
    n = info.n_layers * info.n_experts
    with ContainerExpertSource(folder) as src:
        times = []
        for _ in range(2):
            t = time.perf_counter()
            for layer in range(info.n_layers):
                for expert in range(info.n_experts):
                    src.read(layer, expert, slot)
            times.append((time.perf_counter() - t) / n * 1e6)
    return times[0], times[1]


def pread_and_hash_us(folder: Path, passes: int = 7) -> tuple[float, float]:
    """Least microseconds per blob of a plain pread of every blob, and of pread + hash, over `passes`."""
    info = read_container_info(folder)
    view = memoryview(np.empty(info.blob_nbytes, dtype=np.uint8))
    blobs = [info.blob_offset(layer, expert) for layer in range(info.n_layers) for expert in range(info.n_experts)]
    fd = os.open(folder / EXPERTS_BIN, os.O_RDONLY)
    best = [float("inf"), float("inf")]
    try:
        for _ in range(passes):
            for i, hashed in enumerate((False, True)):
                t = time.perf_counter()
                for offset in blobs:
                    os.preadv(fd, [view], offset)
                    if hashed:
                        blob_hash(view)
                best[i] = min(best[i], (time.perf_counter() - t) / len(blobs) * 1e6)
    finally:
        os.close(fd)
    return best[0], best[1]


def load_cpu_ms(folder: Path, loads: int = 25) -> float:
    """Least process CPU time of `loads` loads (CPU time: what other processes on the machine do not add)."""
    from tierlab.engine.model import load_engine

    best = float("inf")
    for _ in range(loads):
        t = time.process_time()
        load_engine(folder, with_tokenizer=False, warmup=False).close()
        best = min(best, time.process_time() - t)
    return best * 1e3


def decode_tok_s(folder: Path, cache: int) -> float:
    proc = subprocess.run([sys.executable, "-m", "tierlab", "bench", "decode", "--cold", "--model", str(folder), "--cache",
                           str(cache), "--tokens", "32", "--prompt-tokens", "32", "--json"],
                          capture_output=True, text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])["decode_tok_s"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("container", type=Path)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cache", type=int, default=8)
    args = ap.parse_args()
    info = read_container_info(args.container)
    assert info.has_checksums, "the container has no checksums"
    with tempfile.TemporaryDirectory(dir=args.container.parent) as tmp:
        twin = without_checksums(args.container, Path(tmp))
        read_pass_us(twin)  # page cache warm
        passes = {"v1": [], "v2": []}
        for _ in range(5):
            passes["v1"].append(read_pass_us(twin))
            passes["v2"].append(read_pass_us(args.container))
        for name, runs in passes.items():
            first, again = [r[0] for r in runs], [r[1] for r in runs]
            print(f"{name}: first read {statistics.median(first):.0f} us/blob (least {min(first):.0f}), "
                  f"re-read {statistics.median(again):.0f} us/blob (least {min(again):.0f}), median of 5")
        slot = np.random.default_rng(0).integers(0, 256, info.blob_nbytes, dtype=np.uint8)
        hashes = []
        for _ in range(51):  # the median: a hash is short enough to dodge most of the machine's other work
            t = time.perf_counter()
            blob_hash(slot)
            hashes.append(time.perf_counter() - t)
        h = statistics.median(hashes)
        print(f"xxh3_64 of one {info.blob_nbytes:,}-byte blob: {h * 1e6:.0f} us ({info.blob_nbytes / h / 1e9:.1f} GB/s); "
              f"all {info.n_layers * info.n_experts} blobs once: {h * info.n_layers * info.n_experts * 1e3:.1f} ms")
        plain, hashed = pread_and_hash_us(args.container)
        print(f"pread of a blob {plain:.0f} us, pread + hash {hashed:.0f} us (least of 7 passes)")
        load_cpu_ms(twin, 2)
        print(f"load: {load_cpu_ms(twin):.2f} ms CPU without checksums, {load_cpu_ms(args.container):.2f} ms with "
              f"(then {load_cpu_ms(twin):.2f} and {load_cpu_ms(args.container):.2f})")
        if args.rounds:
            decode_tok_s(twin, args.cache)  # compile and warm both
            decode_tok_s(args.container, args.cache)
        for r in range(args.rounds):
            print(f"round {r + 1}: decode tok/s without checksums {decode_tok_s(twin, args.cache):.2f}, "
                  f"with {decode_tok_s(args.container, args.cache):.2f}", flush=True)


if __name__ == "__main__":
    main()
