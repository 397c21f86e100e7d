"""`tierlab inspect DIR`: what a checkpoint or a quantised container holds, and how big it is."""

from __future__ import annotations

import argparse
from pathlib import Path

from tierlab.engine.errors import ModelError


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
    from tierlab.engine.config import load_config
    from tierlab.engine.container import DENSE_FILE, EXPERTS_BIN, read_container_info

    info = read_container_info(folder)
    cfg = load_config(folder)
    experts_file = folder / EXPERTS_BIN
    dense = folder / DENSE_FILE
    return [
        ("kind", "tierlab quantised container"),
        ("architecture", cfg.model_type),
        ("layers", str(info.n_layers)),
        ("experts", f"{info.n_experts} per layer, top-{cfg.top_k}"),
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
    from tierlab.engine.checkpoint import EXPERT_TENSOR, Checkpoint
    from tierlab.engine.config import load_config

    cfg = load_config(folder)
    ckpt = Checkpoint(folder, cfg)
    expert_bytes, dense_bytes, expert_dtypes = 0, 0, set()
    for name, info in ckpt.tensors.items():
        if EXPERT_TENSOR.match(name):
            expert_bytes += info.nbytes
            expert_dtypes.add(info.dtype)
        else:
            dense_bytes += info.nbytes
    per_expert = expert_bytes // max(1, cfg.n_layers * cfg.n_experts)
    return [
        ("kind", "Hugging Face checkpoint"),
        ("architecture", cfg.model_type),
        ("layers", str(cfg.n_layers)),
        ("experts", f"{cfg.n_experts} per layer, top-{cfg.top_k}, {'fused' if ckpt.fused_experts else 'per-expert'} layout"),
        ("hidden", str(cfg.hidden_size)),
        ("inter", str(cfg.moe_inter)),
        ("dtype", "/".join(sorted(expert_dtypes)) or "?"),
        ("bytes per expert", f"{per_expert:,} ({_mib(per_expert)})"),
        ("total expert bytes", f"{expert_bytes:,} ({_mib(expert_bytes)})"),
        ("dense bytes", f"{dense_bytes:,} ({_mib(dense_bytes)})"),
        ("prefix", ckpt.prefix),
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
