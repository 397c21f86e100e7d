"""Quantised expert container: read it as an ExpertSource, write it with `convert`.

Why a container: an MoE decode step touches 8 experts per layer, each a few MiB
in bf16. Stored as one int4/int8 blob per expert (4096-byte aligned), an
expert is one `pread` into a RAM slot and one fused kernel call, at a quarter
(int4) of the bytes. The byte layout is fixed (docs/formats.md) because the
OpenCL tier reads the same blobs.

Folder contents: config.json and tokenizer files (copied), dense.safetensors
(every non-expert tensor, bf16/fp16 as in the source, fp32 -> bf16; with
`dense_bits` the dense projections int8/int4 as qweight + qscales),
experts.bin and tierlab_container.json.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from tierlab.engine.blob_layout import BLOB_ALIGN, GROUP, BlobLayout, check_dims, quant_kind
from tierlab.engine.checkpoint import EXPERT_TENSOR, Checkpoint, to_f32
from tierlab.engine.config import load_config
from tierlab.engine.atomic import write_atomic
from tierlab.engine.errors import ModelError
from tierlab.engine.kernels import qmatvec
from tierlab.engine.qlinear import quantize_matrix
from tierlab.engine.quant import build_blob_fast
from tierlab.engine.safetensors_file import TensorSpec, read_tensor, write_file

CONTAINER_JSON = "tierlab_container.json"
EXPERTS_BIN = "experts.bin"
DENSE_FILE = "dense.safetensors"
FORMAT_NAME = "tierlab-experts"
FORMAT_VERSION = 1
COPIED_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


# --- container metadata ---------------------------------------------------------------------


@dataclass(frozen=True)
class ContainerInfo:
    """Contents of tierlab_container.json."""

    bits: int
    group: int
    n_layers: int
    n_experts: int
    hidden: int
    inter: int
    blob_nbytes: int
    blob_stride: int
    layer_offsets: list[int]
    source: str
    prefix: str
    dense_bits: int = 0  # 0: dense tensors as in the source; 8 / 4: projections quantised
    format: str = FORMAT_NAME
    version: int = FORMAT_VERSION

    @property
    def kind(self) -> str:
        return quant_kind(self.bits)

    @property
    def experts_nbytes(self) -> int:
        """Minimum size of a complete experts.bin."""
        return self.blob_offset(self.n_layers - 1, self.n_experts - 1) + self.blob_nbytes

    def blob_offset(self, layer: int, expert: int) -> int:
        return self.layer_offsets[layer] + expert * self.blob_stride

    def to_json(self) -> dict:
        d = asdict(self)
        return {"format": d.pop("format"), "version": d.pop("version"), **d}


def is_container(folder: str | Path) -> bool:
    return (Path(folder) / CONTAINER_JSON).is_file()


def read_container_info(folder: str | Path) -> ContainerInfo:
    """Load and validate tierlab_container.json (ModelError naming the file otherwise)."""
    path = Path(folder) / CONTAINER_JSON
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise ModelError("not a tierlab container (no tierlab_container.json)", path) from None
    except (OSError, ValueError) as exc:
        raise ModelError(f"unreadable container metadata ({str(exc).splitlines()[0]})", path) from None
    if not isinstance(raw, dict) or raw.get("format") != FORMAT_NAME:
        raise ModelError(f"format is not {FORMAT_NAME!r}", path)
    if raw.get("version") != FORMAT_VERSION:
        raise ModelError(f"unsupported container version {raw.get('version')!r} (this tierlab reads {FORMAT_VERSION})", path)
    try:
        bits, group = int(raw["bits"]), int(raw["group"])
        n_layers, n_experts = int(raw["n_layers"]), int(raw["n_experts"])
        hidden, inter = int(raw["hidden"]), int(raw["inter"])
        blob_nbytes = int(raw["blob_nbytes"])
        offsets = [int(o) for o in raw["layer_offsets"]]
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelError(f"missing or malformed field {exc}", path) from None
    if bits not in (4, 8):
        raise ModelError(f"bits must be 4 or 8, got {bits}", path)
    try:
        check_dims(hidden, inter, group)
    except ValueError as exc:
        raise ModelError(str(exc), path) from None
    layout = BlobLayout(quant_kind(bits), hidden, inter)
    if blob_nbytes != layout.nbytes:
        raise ModelError(f"blob_nbytes {blob_nbytes} does not match the layout ({layout.nbytes})", path)
    stride = int(raw.get("blob_stride", layout.stride))
    if stride != layout.stride:
        raise ModelError(f"blob_stride {stride} does not match the layout ({layout.stride})", path)
    if n_layers <= 0 or n_experts <= 0 or len(offsets) != n_layers:
        raise ModelError(f"layer_offsets has {len(offsets)} entries for {n_layers} layers", path)
    for i, off in enumerate(offsets):
        if off % BLOB_ALIGN or (i and off < offsets[i - 1] + n_experts * stride):
            raise ModelError(f"layer_offsets[{i}] = {off} is misaligned or overlaps the previous layer", path)
    try:
        dense_bits = int(raw.get("dense_bits", 0))
    except (TypeError, ValueError):
        dense_bits = -1
    if dense_bits not in (0, 4, 8):
        raise ModelError(f"dense_bits must be 0, 4 or 8, got {raw.get('dense_bits')!r}", path)
    return ContainerInfo(
        bits, group, n_layers, n_experts, hidden, inter, blob_nbytes, stride, offsets,
        str(raw.get("source", "")), str(raw.get("prefix", "")), dense_bits,
    )


def new_container_info(bits: int, n_layers: int, n_experts: int, hidden: int, inter: int, source: str,
                       prefix: str, dense_bits: int = 0) -> ContainerInfo:
    """The metadata of a container of that shape: the blob layout and each layer's offset."""
    layout = BlobLayout(quant_kind(bits), hidden, inter)
    offsets = [layer * layout.stride * n_experts for layer in range(n_layers)]
    return ContainerInfo(bits, GROUP, n_layers, n_experts, hidden, inter, layout.nbytes, layout.stride,
                         offsets, source, prefix, dense_bits)


class ExpertBlobWriter:
    """Writes experts.bin blob by blob: the one way a container's experts are written
    (convert, make-synthetic), so every container has the same layout::

        with ExpertBlobWriter(folder, info) as w:
            for layer ...: for expert ...: w.add(layer, expert, blob)
        write_manifest(folder, w.info)   # after dense.safetensors is written

    add() takes exactly blob_nbytes bytes (any buffer) in any order and writes them at
    their offset; finish() checks every blob was added and pads experts.bin to its full
    size. Leaving the `with` block calls finish() unless it raised.
    """

    def __init__(self, folder: str | Path, info: ContainerInfo) -> None:
        self.folder = Path(folder)
        self.info = info
        self._added = np.zeros((info.n_layers, info.n_experts), dtype=bool)
        self._file = open(self.folder / EXPERTS_BIN, "wb")
        self._done = False

    def add(self, layer: int, expert: int, blob) -> None:
        """Write one expert's blob (blob_nbytes bytes) at its offset."""
        info = self.info
        if not (0 <= layer < info.n_layers and 0 <= expert < info.n_experts):
            raise IndexError(f"expert ({layer}, {expert}) outside {info.n_layers} layers x {info.n_experts} experts")
        view = memoryview(blob).cast("B")
        if len(view) != info.blob_nbytes:
            raise ValueError(f"blob of {len(view)} bytes, the container's blobs have {info.blob_nbytes}")
        offset = info.blob_offset(layer, expert)
        if self._file.tell() != offset:
            self._file.seek(offset)
        self._file.write(view)
        self._added[layer, expert] = True

    def finish(self) -> ContainerInfo:
        """Close experts.bin at its full size; ModelError if a blob is missing."""
        if self._done:
            return self.info
        missing = np.argwhere(~self._added)
        if len(missing):
            layer, expert = missing[0]
            self._file.close()
            raise ModelError(f"{len(missing)} blobs were never written, the first ({layer}, {expert})",
                             self.folder / EXPERTS_BIN)
        self._file.truncate(self.info.blob_offset(self.info.n_layers - 1, self.info.n_experts - 1)
                            + self.info.blob_stride)
        self._file.close()
        self._done = True
        return self.info

    def close(self) -> None:
        """Close experts.bin without finishing (after an error)."""
        self._file.close()

    def __enter__(self) -> "ExpertBlobWriter":
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is None:
            self.finish()
        else:
            self.close()


def write_manifest(folder: str | Path, info: ContainerInfo) -> ContainerInfo:
    """Write tierlab_container.json, the last file of a container (its presence marks one)."""
    write_atomic(Path(folder) / CONTAINER_JSON, json.dumps(info.to_json(), indent=1) + "\n")
    return info


# --- the ExpertSource -----------------------------------------------------------------------


class ContainerExpertSource:
    """ExpertSource over a quantised container: one pread per expert, fused kernel per call."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        self.info = read_container_info(self.folder)
        self.kind = self.info.kind
        self.hidden = self.info.hidden
        self.inter = self.info.inter
        self.n_layers = self.info.n_layers
        self.n_experts = self.info.n_experts
        self.blob_nbytes = self.info.blob_nbytes
        self._forward = qmatvec.EXPERT_FORWARD[self.kind]
        path = self.folder / EXPERTS_BIN
        try:
            self._fd = os.open(path, os.O_RDONLY)
        except OSError as exc:
            raise ModelError(f"cannot open ({exc.strerror})", path) from None
        size = os.fstat(self._fd).st_size
        if size < self.info.experts_nbytes:
            os.close(self._fd)
            self._fd = -1
            raise ModelError(f"truncated: {size} bytes, the container needs {self.info.experts_nbytes}", path)

    def read(self, layer: int, expert: int, out: np.ndarray) -> None:
        """Fill out[:blob_nbytes] with expert (layer, expert), in one preadv."""
        if not (0 <= layer < self.n_layers and 0 <= expert < self.n_experts):
            raise IndexError(f"expert ({layer}, {expert}) outside {self.n_layers} layers x {self.n_experts} experts")
        view = memoryview(out).cast("B")[: self.blob_nbytes]
        if len(view) < self.blob_nbytes:
            raise ValueError(f"slot of {len(view)} bytes is smaller than one expert ({self.blob_nbytes})")
        offset = self.info.blob_offset(layer, expert)
        got = os.preadv(self._fd, [view], offset)
        while got < self.blob_nbytes:  # short reads are rare (signals, network filesystems)
            more = os.preadv(self._fd, [view[got:]], offset + got)
            if more <= 0:
                raise ModelError(f"short read of expert ({layer}, {expert})", self.folder / EXPERTS_BIN)
            got += more

    def forward(self, blob: np.ndarray, x: np.ndarray, y: np.ndarray, w: float) -> None:
        """y += w * down(silu(gate x) * (up x)) for one blob filled by read()."""
        self._forward(blob, self.hidden, self.inter, x, y, w)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> "ContainerExpertSource":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        fd = getattr(self, "_fd", -1)
        if fd >= 0:
            os.close(fd)


# --- writing ---------------------------------------------------------------------------------

# The dense projections `--dense-bits` quantises: every matrix a token multiplies
# whole. The router (mlp.gate), the shared expert's one-row gate, the embedding
# and the norms stay as they are (small, or read one row at a time).
_QUANT_DENSE_RE = re.compile(
    r"(^|\.)(q_proj|k_proj|v_proj|o_proj|in_proj_qkv|in_proj_z|in_proj_b|in_proj_a|out_proj"
    r"|gate_proj|up_proj|down_proj)\.weight$|^lm_head\.weight$"
)
_QUANT_SOURCE_DTYPES = ("BF16", "F16", "F32")


@dataclass(frozen=True)
class DenseEntry:
    """One tensor of dense.safetensors: a copy of the source tensor `source` (a relative
    name), or its qweight / qscales part."""

    spec: TensorSpec
    source: str
    part: str = "copy"  # "copy" | "qweight" | "qscales"


def quantises(name: str, dtype: str, shape: list[int], dense_bits: int) -> bool:
    """Whether `convert --dense-bits` stores this dense tensor quantised."""
    return (bool(dense_bits) and _QUANT_DENSE_RE.search(name) is not None and dtype in _QUANT_SOURCE_DTYPES
            and len(shape) == 2 and shape[1] % GROUP == 0 and shape[0] > 0)


def dense_entries(name: str, dtype: str, shape, dense_bits: int, source: str) -> list[DenseEntry]:
    """What one dense source tensor becomes in dense.safetensors: a copy (fp32 as bf16), or its
    qweight and qscales parts; the one rule for every container writer."""
    if quantises(name, dtype, list(shape), dense_bits):
        rows, cols = shape
        return [DenseEntry(TensorSpec(name + ".qweight", "I8" if dense_bits == 8 else "U8",
                                      (rows, cols if dense_bits == 8 else cols // 2)), source, "qweight"),
                DenseEntry(TensorSpec(name + ".qscales", "F32", (rows, cols // GROUP)), source, "qscales")]
    return [DenseEntry(TensorSpec(name, "BF16" if dtype == "F32" else dtype, tuple(shape)), source)]


def dense_part(entry: DenseEntry, array: np.ndarray | None, dense_bits: int, memo: dict) -> np.ndarray:
    """The stored bytes of one entry from its source tensor's array (as stored in the source);
    a quantised matrix is computed once for its two parts (its second part may pass None)."""
    import ml_dtypes

    if entry.part == "copy":
        if array.dtype == np.float32 and entry.spec.dtype == "BF16":
            return array.astype(ml_dtypes.bfloat16).view(np.uint16)
        return array
    if memo.get("source") != entry.source:
        memo["source"], memo["matrix"] = entry.source, quantize_matrix(to_f32(array), dense_bits)
    m = memo["matrix"]
    return m.q if entry.part == "qweight" else m.scales


DENSE_WRITER_METADATA = {"format": "pt", "writer": "tierlab convert"}


def _dense_plan(ckpt: Checkpoint, dense_bits: int = 0) -> list[DenseEntry]:
    """Every tensor of dense.safetensors, in stored name order, under its stored name."""
    plan = []
    for rel, info in sorted(ckpt.tensors.items(), key=lambda item: item[1].name):
        if not EXPERT_TENSOR.match(rel):
            plan += dense_entries(info.name, info.dtype, info.shape, dense_bits, rel)
    return plan


def _entry_array(ckpt: Checkpoint, entry: DenseEntry, dense_bits: int, memo: dict) -> np.ndarray:
    """The bytes of one plan entry, read as stored (no load-time normalisation)."""
    quantised = entry.part != "copy" and memo.get("source") == entry.source
    return dense_part(entry, None if quantised else read_tensor(ckpt.tensors[entry.source]), dense_bits, memo)


def write_dense(ckpt: Checkpoint, path: Path, progress: Callable[[str], None] | None = None,
                dense_bits: int = 0) -> int:
    """Stream every non-expert tensor into one safetensors file; returns its data bytes.

    Streamed (header, then tensors one at a time) so that peak memory is one
    tensor, not the whole embedding + lm_head. With dense_bits 8 or 4 the
    projections `quantises()` names are stored as `<name>.qweight` (I8, or U8
    planar nibbles) and `<name>.qscales` (F32), as in docs/formats.md.
    """
    plan = _dense_plan(ckpt, dense_bits)
    memo: dict = {}

    def arrays():
        for e in plan:
            yield _entry_array(ckpt, e, dense_bits, memo)
            if progress:
                progress(e.spec.name)

    metadata = {**DENSE_WRITER_METADATA, "dense_bits": str(dense_bits)}
    return write_file(path, [e.spec for e in plan], arrays(), metadata)


PARTIAL_MARK = ".tierlab-partial"  # in a `<out>.partial` folder: convert made it, so convert may remove it


def _is_container(folder: Path) -> bool:
    return (folder / CONTAINER_JSON).is_file()


def _is_empty_dir(folder: Path) -> bool:
    return folder.is_dir() and not any(folder.iterdir())


def _check_out_dir(out: Path, force: bool, model_dir: Path) -> None:
    """Refuse an --out that convert would have to delete but the user did not hand over.

    ``--force`` replaces only a tierlab container (a folder holding
    tierlab_container.json); any other non-empty folder is left alone.
    """
    src, dst = model_dir.resolve(), out.resolve()
    if dst == src or dst in src.parents or src in dst.parents:
        raise ModelError("the output folder must not be, contain or sit inside the model folder", out)
    if out.is_symlink():
        raise ModelError("is a symbolic link; name the folder itself", out)
    if out.exists() and not out.is_dir():
        raise ModelError("exists and is not a folder", out)
    if out.is_dir() and not _is_empty_dir(out):
        if not _is_container(out):
            raise ModelError(f"exists, is not empty and is not a tierlab container (no {CONTAINER_JSON}); "
                             "name a new or empty folder", out)
        if not force:
            raise ModelError("exists and is not empty (use --force to overwrite)", out)
    partial = out.with_name(out.name + ".partial")
    if (partial.exists() or partial.is_symlink()) and not (
            partial.is_dir() and not partial.is_symlink()
            and (_is_empty_dir(partial) or (partial / PARTIAL_MARK).is_file())):
        raise ModelError("exists and was not made by tierlab convert; move it away", partial)


def convert(
    model_dir: str | Path,
    out_dir: str | Path,
    bits: int = 4,
    group: int = GROUP,
    force: bool = False,
    progress: Callable[[int, int, str], None] | None = None,
    dense_bits: int = 0,
) -> ContainerInfo:
    """Convert a Hugging Face MoE checkpoint into a quantised container, layer by layer.

    progress(done, total, what) is called after each layer (total = n_layers + 1
    for the dense tensors). Everything is written to `<out>.partial` and renamed
    at the end, so an interrupted conversion never looks like a container.
    """
    model_dir, out = Path(model_dir), Path(out_dir)
    if bits not in (4, 8):
        raise ModelError(f"--bits must be 4 or 8, got {bits}")
    if dense_bits not in (0, 4, 8):
        raise ModelError(f"--dense-bits must be 4 or 8 (or unset), got {dense_bits}")
    if group != GROUP:
        raise ModelError(f"--group must be {GROUP} (the only group size the kernels support), got {group}")
    cfg = load_config(model_dir)
    try:
        check_dims(cfg.hidden_size, cfg.moe_inter, group)
    except ValueError as exc:
        raise ModelError(str(exc), model_dir / "config.json") from None
    _check_out_dir(out, force, model_dir)
    ckpt = Checkpoint(model_dir, cfg)
    info = new_container_info(bits, cfg.n_layers, cfg.n_experts, cfg.hidden_size, cfg.moe_inter,
                              str(model_dir.resolve()), ckpt.prefix, dense_bits)

    tmp = out.with_name(out.name + ".partial")
    if tmp.exists():  # an interrupted convert's: _check_out_dir checked it holds PARTIAL_MARK
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    (tmp / PARTIAL_MARK).touch()
    total = cfg.n_layers + 1
    try:
        with ExpertBlobWriter(tmp, info) as blobs:
            for layer in range(cfg.n_layers):
                for expert in range(cfg.n_experts):
                    blobs.add(layer, expert, build_blob_fast(*ckpt.read_expert(layer, expert), bits))
                if progress:
                    progress(layer + 1, total, f"layer {layer + 1}/{cfg.n_layers}")
        write_dense(ckpt, tmp / DENSE_FILE, dense_bits=dense_bits)
        for name in COPIED_FILES:
            if (model_dir / name).is_file():
                shutil.copy2(model_dir / name, tmp / name)
        info = write_manifest(tmp, blobs.info)  # the info as the writer finished it
        if progress:
            progress(total, total, "dense tensors")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    (tmp / PARTIAL_MARK).unlink()
    if out.exists():  # a tierlab container or an empty folder: _check_out_dir refused anything else
        shutil.rmtree(out)
    os.replace(tmp, out)
    return info
