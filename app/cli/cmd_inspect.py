"""`tierlab inspect DIR`: what a checkpoint or a quantised container holds, and how big it is.

It opens the folder with the checks loading runs (engine/model_files.py), so a
folder inspect accepts is one `load` accepts; `--verify` also hashes every
expert blob and the dense file of a container against its checksums.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from tierlab.engine.errors import ModelError


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "inspect",
        help="summarise a model folder or quantised container",
        description="Print a model's or container's architecture, sizes and bytes per expert, after the "
                    "checks loading runs (exit 2 on a defect loading would refuse).",
    )
    p.add_argument("path", help="checkpoint folder or tierlab container")
    p.add_argument("--verify", action="store_true",
                   help="hash every expert blob and the dense file of a container against its checksums; "
                        "one line per damaged file or blob, exit 2 if any")
    p.set_defaults(run=run)


def _mib(n: int) -> str:
    return f"{n / 2**20:,.2f} MiB" if n < 2**30 else f"{n / 2**30:,.2f} GiB"


def container_summary(files) -> list[tuple[str, str]]:
    from tierlab.engine.container import CHECKSUM_FILE, DENSE_FILE, EXPERTS_BIN

    info, cfg, folder = files.container, files.config, files.folder
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
         + f"; {EXPERTS_BIN} {_mib(experts_file.stat().st_size)}"),
        ("dense bytes", f"{dense.stat().st_size:,} ({_mib(dense.stat().st_size)})"),
        ("dense dtype", f"projections int{info.dense_bits}, group {info.group}; router, embedding, norms as in the source"
         if info.dense_bits else "as in the source (bf16/fp16)"),
        ("checksums", f"{info.checksum} per blob ({CHECKSUM_FILE}) and of {DENSE_FILE}; verified on first read"
         if info.has_checksums else f"no checksums (container version {info.version}): blobs are not verified"),
        ("source", info.source or "?"),
        ("prefix", info.prefix or "?"),
    ]


def checkpoint_summary(files) -> list[tuple[str, str]]:
    from tierlab.engine.checkpoint import EXPERT_TENSOR

    cfg, ckpt = files.config, files.checkpoint
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


def verify(files) -> None:
    """Hash a container's blobs and dense file: one line per damaged one, then a summary;
    ModelError (exit 2) if anything is damaged."""
    import sys

    from tierlab.engine.container import DENSE_FILE, EXPERTS_BIN, verify_container

    if files.container is None:
        print("verify: no checksums (a Hugging Face checkpoint): nothing to verify")
        return
    if not files.container.has_checksums:
        print(f"verify: no checksums (container version {files.container.version}): nothing to verify")
        return
    tty = sys.stderr.isatty()

    def progress(done: int, total: int) -> None:
        sys.stderr.write(f"\rverifying layer {done}/{total}" + ("\n" if done == total else ""))
        sys.stderr.flush()

    report = verify_container(files.folder, progress if tty else None)
    for layer, expert in report.damaged:
        print(f"{files.folder / EXPERTS_BIN}: layer {layer} expert {expert}: checksum mismatch")
    if not report.dense_ok:
        print(f"{files.folder / DENSE_FILE}: checksum mismatch")
    damaged = len(report.damaged) + (not report.dense_ok)
    summary = (f"{len(report.damaged)} of {report.blobs} expert blobs"
               f"{' and ' + DENSE_FILE if not report.dense_ok else ''} do not match their checksums")
    if damaged:
        raise ModelError(f"damaged: {summary}", files.folder)
    print(f"verify: {report.blobs} expert blobs and {DENSE_FILE} match their checksums")


def run(args: argparse.Namespace) -> int:
    from tierlab.engine.model_files import open_model_files

    files = open_model_files(Path(args.path))
    try:
        rows = container_summary(files) if files.container is not None else checkpoint_summary(files)
        width = max(len(k) for k, _ in rows)
        for key, value in rows:
            print(f"{key:<{width}}  {value}")
        if args.verify:
            verify(files)
    finally:
        files.close()
    return 0
