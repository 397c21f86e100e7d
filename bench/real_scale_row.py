#!/usr/bin/env python3
"""bench/real_scale.sh's helpers: the disk's bandwidth, a GGUF's bytes per token, one table row.

    real_scale_row.py disk CONTAINER        GB/s of random expert-sized O_DIRECT reads of experts.bin
    real_scale_row.py gguf-bytes FILE.gguf   weight bytes one llama.cpp decode token reads (needs gguf-py)
    real_scale_row.py row ENGINE MODEL LIMIT ARM   one markdown row from the JSON line in $LINE

A row's "reads alone" is the time one token would take if it did nothing but
its reads: the bytes it read from disk over the disk's bandwidth plus the
weight bytes it reads from memory over the memory bandwidth ($DISK and $BW,
GB/s; $GGUF_BYTES for llama.cpp, tierlab's own count for tierlab).
"""

from __future__ import annotations

import json
import mmap
import os
import random
import sys
import time
from pathlib import Path

EXPERT_BYTES = 1769472  # one int4 expert of the 2048 x 512 shape: the read size tierlab's misses make


def disk_gbs(container: str, reads: int = 64) -> float:
    path = os.path.join(container, "experts.bin")
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)  # past the page cache, so the disk is measured
    buf, blocks = mmap.mmap(-1, EXPERT_BYTES), os.path.getsize(path) // EXPERT_BYTES
    rng = random.Random(0)
    t0 = time.perf_counter()
    for _ in range(reads):
        os.preadv(fd, [buf], rng.randrange(blocks) * EXPERT_BYTES)
    os.close(fd)
    return reads * EXPERT_BYTES / (time.perf_counter() - t0) / 1e9


def gguf_bytes(path: str) -> int:
    """Weight bytes one llama.cpp decode token reads: the side-by-side script's count."""
    from llama_side_by_side import gguf_bytes_per_token  # bench/ is sys.path[0] when run as a script

    return gguf_bytes_per_token(Path(path))


def row(engine: str, model: str, limit: str, arm: str) -> str:
    r = json.loads(os.environ["LINE"])
    cg = "none" if limit == "none" else f"{limit} GB"
    name = os.path.basename(model.rstrip("/"))
    lever = {"off": "off", "j2": "on J=2", "j1": "on J=1", "default": "its defaults", "norepack": "no repack"}[arm]
    if "error" in r:
        return f"| {engine} | {name} | | {cg} | {lever} | {r['error']} | | | | | | | |"
    mem = r["weight_bytes"]["total"] if engine == "tierlab" else int(os.environ["GGUF_BYTES"])
    disk = r["disk_mb_per_token"] * 2**20
    bound_ms = 1e3 * (disk / (float(os.environ["DISK"]) * 1e9) + mem / (float(os.environ["BW"]) * 1e9))
    ms = 1e3 / r["decode_tok_s"]
    hit = f"{r['ram_hit']:.1f}%" if "ram_hit" in r else ""
    slots = f"{r['cache_slots']}/{r['n_experts']}" if "cache_slots" in r else ""
    return (f"| {engine} | {name} | {r.get('dense_kind', 'bf16')} | {cg} | {lever} | {r['prefill_tok_s']:.2f} | "
            f"{r['decode_tok_s']:.2f} | {hit} | {r['disk_mb_per_token']:.0f} | {r['peak_rss_mb']:.0f} MiB | {slots} | "
            f"{ms:.0f} | {bound_ms:.0f} ({ms / bound_ms:.1f}x) |")


if __name__ == "__main__":
    what, args = sys.argv[1], sys.argv[2:]
    if what == "disk":
        print(round(disk_gbs(args[0]), 2))
    elif what == "gguf-bytes":
        print(gguf_bytes(args[0]))
    elif what == "row":
        print(row(*args))
    else:
        sys.exit(f"unknown helper {what!r}")
