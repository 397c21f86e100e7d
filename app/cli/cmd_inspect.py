"""`tierlab inspect DIR`: what a checkpoint or a quantised container holds, and how big it is."""

from __future__ import annotations

import argparse
from pathlib import Path

from tierlab.engine.errors import ModelError

_ELEM_BYTES = {"BF16": 2, "F16": 2, "F32": 4, "F64": 8}


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "inspect",
        help="summarise a model folder or quantised container",
        description="Print a model's or container's architecture, sizes and bytes per expert.",
    )
    p.add_argument("path", help="checkpoint folder or tierlab container")
    p.set_defaults(run=run)


def _mib(n: int) -> str:
    return f"{n / 2**20:,.2f} MiB" if n < 2**30 else f"{n / 2**30:,.2f} GiB"


def container_summary(folder: Path) -> list[tuple[str, str]]:
    from tierlab.engine.container import DENSE_FILE, EXPERTS_BIN, read_container_info, read_moe_dims

    info = read_container_info(folder)
    dims = read_moe_dims(folder)
    experts_file = folder / EXPERTS_BIN
    dense = folder / DENSE_FILE
    return [
        ("kind", "tierlab quantised container"),
        ("architecture", dims.architecture),
        ("layers", str(info.n_layers)),
        ("experts", f"{info.n_experts} per layer, top-{dims.top_k}"),
        ("hidden", str(info.hidden)),
        ("inter", str(info.inter)),
        ("dtype", f"int{info.bits}, symmetric, group {info.group}, float32 scales"),
        ("bytes per expert", f"{info.blob_nbytes:,} ({_mib(info.blob_nbytes)}), stride {info.blob_stride:,}"),
        ("total expert bytes", f"{info.n_layers * info.n_experts * info.blob_nbytes:,} ({_mib(info.n_layers * info.n_experts * info.blob_nbytes)})"
         + (f"; {EXPERTS_BIN} {_mib(experts_file.stat().st_size)}" if experts_file.exists() else f"; {EXPERTS_BIN} missing")),
        ("dense bytes", f"{dense.stat().st_size:,} ({_mib(dense.stat().st_size)})" if dense.exists() else f"{DENSE_FILE} missing"),
        ("dense dtype", f"projections int{info.dense_bits}, group {info.group}; router, embedding, norms as in the source"
         if info.dense_bits else "as in the source (bf16/fp16)"),
        ("source", info.source or "?"),
        ("prefix", info.prefix or "?"),
    ]


def checkpoint_summary(folder: Path) -> list[tuple[str, str]]:
    from tierlab.engine.container import Checkpoint, find_layer_prefix, is_ignored, read_moe_dims, _EXPERT_RE

    dims = read_moe_dims(folder)
    ckpt = Checkpoint(folder)
    names = ckpt.names()
    prefix = find_layer_prefix(names)
    expert_bytes, dense_bytes, expert_dtypes = 0, 0, set()
    fused = False
    for name in names:
        if is_ignored(name):
            continue
        dtype, shape = ckpt.dtype_shape(name)
        n = _ELEM_BYTES.get(dtype, 1)
        for s in shape:
            n *= s
        if _EXPERT_RE.match(name):
            expert_bytes += n
            expert_dtypes.add(dtype)
            fused = fused or name.split(".experts.")[1].startswith("gate_up_proj")
        else:
            dense_bytes += n
    ckpt.close()
    per_expert = expert_bytes // max(1, dims.n_layers * dims.n_experts)
    return [
        ("kind", "Hugging Face checkpoint"),
        ("architecture", dims.architecture),
        ("layers", str(dims.n_layers)),
        ("experts", f"{dims.n_experts} per layer, top-{dims.top_k}, {'fused' if fused else 'per-expert'} layout"),
        ("hidden", str(dims.hidden)),
        ("inter", str(dims.inter)),
        ("dtype", "/".join(sorted(expert_dtypes)) or "?"),
        ("bytes per expert", f"{per_expert:,} ({_mib(per_expert)})"),
        ("total expert bytes", f"{expert_bytes:,} ({_mib(expert_bytes)})"),
        ("dense bytes", f"{dense_bytes:,} ({_mib(dense_bytes)})"),
        ("prefix", prefix),
    ]


def run(args: argparse.Namespace) -> int:
    from tierlab.engine.container import is_container

    folder = Path(args.path)
    if not folder.is_dir():
        raise ModelError("not a folder", folder)
    rows = container_summary(folder) if is_container(folder) else checkpoint_summary(folder)
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    return 0
