"""Quantised expert container: read it as an ExpertSource, write it with `convert`.

Why a container: an MoE decode step touches 8 experts per layer, each a few MiB
in bf16. Stored as one int4/int8 blob per expert (4096-byte aligned), an
expert is one `pread` into a RAM slot and one fused kernel call, at a quarter
(int4) of the bytes. The byte layout is fixed (docs/formats.md) because the
OpenCL tier reads the same blobs.

Folder contents: config.json and tokenizer files (copied), dense.safetensors
(every non-expert tensor, bf16/fp16 as in the source, fp32 -> bf16; with
`dense_bits` the dense projections int8/int4 as qweight + qscales),
experts.bin, experts.xxh (one checksum per blob) and tierlab_container.json.

Integrity: every blob has an xxh3_64 checksum in experts.xxh, checked the
first time this process reads the blob (ContainerExpertSource.read) and, with
the dense file's, by `tierlab inspect --verify` (verify_container).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable

import numpy as np
import xxhash

from tierlab.engine.blob_layout import BLOB_ALIGN, GROUP, BlobLayout, check_dims, quant_kind
from tierlab.engine.checkpoint import EXPERT_TENSOR, Checkpoint, to_f32
from tierlab.engine.config import load_config
from tierlab.engine.atomic import write_atomic
from tierlab.engine.errors import ModelError
from tierlab.engine.kernels import qmatvec
from tierlab.engine.qlinear import quantize_matrix
from tierlab.engine.readahead import FileRange
from tierlab.engine.quant import build_blob_fast
from tierlab.engine.safetensors_file import TensorSpec, read_tensor, write_file

CONTAINER_JSON = "tierlab_container.json"
EXPERTS_BIN = "experts.bin"
DENSE_FILE = "dense.safetensors"
CHECKSUM_FILE = "experts.xxh"
FORMAT_NAME = "tierlab-experts"
FORMAT_VERSION = 2  # 2: per-blob checksums; 1 (no checksums) still reads
READ_VERSIONS = (1, 2)
CHECKSUM_KIND = "xxh3_64"
_HASH_CHUNK = 1 << 20  # bytes hashed per read when hashing a whole file (one reused buffer)
COPIED_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


class ChecksumMismatch(ModelError):
    """A blob whose bytes do not match its checksum: the file is damaged."""

    def __init__(self, path: Path, layer: int, expert: int) -> None:
        self.layer, self.expert = layer, expert
        super().__init__(f"layer {layer} expert {expert}: the blob does not match its checksum (the file is "
                         "damaged; `tierlab inspect --verify` lists every damaged blob)", path)


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
    #: checksum kind ("xxh3_64"), or "" for a container without checksums (version 1)
    checksum: str = ""
    #: hex xxh3_64 of the checksum file experts.xxh and of dense.safetensors ("" if not hashed)
    checksum_file_hash: str = ""
    dense_hash: str = ""
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

    @property
    def has_checksums(self) -> bool:
        return bool(self.checksum)

    @property
    def experts_file_nbytes(self) -> int:
        """Size of experts.bin as the writer leaves it: every blob padded to its stride."""
        return self.layer_offsets[-1] + self.n_experts * self.blob_stride

    def to_json(self) -> dict:
        d = asdict(self)
        d.pop("version")  # the content decides: version 2 holds checksums, version 1 none
        head = {"format": d.pop("format"), "version": FORMAT_VERSION if self.checksum else 1}
        kind, file_hash, dense_hash = d.pop("checksum"), d.pop("checksum_file_hash"), d.pop("dense_hash")
        if kind:
            d["checksums"] = {"kind": kind, "experts": CHECKSUM_FILE, "experts_hash": file_hash,
                              "dense": DENSE_FILE, "dense_hash": dense_hash}
        return {**head, **d}


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
    version = raw.get("version")
    if version not in READ_VERSIONS or isinstance(version, bool):
        raise ModelError(f"unsupported container version {version!r} (this tierlab reads "
                         f"{', '.join(map(str, READ_VERSIONS))})", path)
    try:
        bits, group = int(raw["bits"]), int(raw["group"])
        n_layers, n_experts = int(raw["n_layers"]), int(raw["n_experts"])
        hidden, inter = int(raw["hidden"]), int(raw["inter"])
        blob_nbytes = int(raw["blob_nbytes"])
        offsets = [int(o) for o in raw["layer_offsets"]]
    except (KeyError, TypeError, ValueError, OverflowError) as exc:
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
    try:
        stride = int(raw.get("blob_stride", layout.stride))
    except (TypeError, ValueError, OverflowError):
        stride = -1
    if stride != layout.stride:
        raise ModelError(f"blob_stride {stride} does not match the layout ({layout.stride})", path)
    if n_layers <= 0 or n_experts <= 0 or len(offsets) != n_layers:
        raise ModelError(f"layer_offsets has {len(offsets)} entries for {n_layers} layers", path)
    if group != GROUP:
        raise ModelError(f"group must be {GROUP}, got {group}", path)
    for i, off in enumerate(offsets):
        if off < 0 or off % BLOB_ALIGN or (i and off < offsets[i - 1] + n_experts * stride):
            raise ModelError(f"layer_offsets[{i}] = {off} is misaligned or overlaps the previous layer", path)
    try:
        dense_bits = int(raw.get("dense_bits", 0))
    except (TypeError, ValueError, OverflowError):
        dense_bits = -1
    if dense_bits not in (0, 4, 8):
        raise ModelError(f"dense_bits must be 0, 4 or 8, got {raw.get('dense_bits')!r}", path)
    kind, file_hash, dense_hash = _read_checksum_fields(raw, version, path)
    return ContainerInfo(
        bits, group, n_layers, n_experts, hidden, inter, blob_nbytes, stride, offsets,
        str(raw.get("source", "")), str(raw.get("prefix", "")), dense_bits, kind, file_hash, dense_hash,
        version=version,
    )


def _read_checksum_fields(raw: dict, version: int, path: Path) -> tuple[str, str, str]:
    """(kind, hash of experts.xxh, hash of dense.safetensors); empty for version 1."""
    if version == 1:
        return "", "", ""
    block = raw.get("checksums")
    if not isinstance(block, dict):
        raise ModelError("version 2 needs a \"checksums\" object", path)
    if block.get("kind") != CHECKSUM_KIND:
        raise ModelError(f"checksum kind {block.get('kind')!r} is not {CHECKSUM_KIND!r}", path)
    if block.get("experts") != CHECKSUM_FILE or block.get("dense") != DENSE_FILE:
        raise ModelError(f"checksums must name {CHECKSUM_FILE} and {DENSE_FILE}", path)
    hashes = block.get("experts_hash"), block.get("dense_hash")
    for name, value in zip(("experts_hash", "dense_hash"), hashes):
        if not (isinstance(value, str) and re.fullmatch(r"[0-9a-f]{16}", value)):
            raise ModelError(f"checksums.{name} must be 16 hex digits, got {value!r}", path)
    return CHECKSUM_KIND, hashes[0], hashes[1]


def check_against_config(info: ContainerInfo, cfg, folder: str | Path) -> None:
    """Refuse a container whose manifest does not describe the model config.json describes."""
    path = Path(folder) / CONTAINER_JSON
    for what, have, want in (("layers", info.n_layers, cfg.n_layers), ("experts per layer", info.n_experts, cfg.n_experts),
                             ("hidden size", info.hidden, cfg.hidden_size),
                             ("expert inter size", info.inter, cfg.moe_inter)):
        if have != want:
            raise ModelError(f"the container has {what} {have} but config.json says {want}", path)


# --- checksums -------------------------------------------------------------------------------


def blob_hash(blob) -> int:
    """The checksum of one blob's bytes (a buffer of blob_nbytes)."""
    return xxhash.xxh3_64_intdigest(blob)


def file_hash(path: str | Path) -> str:
    """Hex xxh3_64 of a whole file, read in bounded chunks."""
    h = xxhash.xxh3_64()
    try:
        buffer = bytearray(_HASH_CHUNK)
        view = memoryview(buffer)
        with open(path, "rb") as f:
            while n := f.readinto(buffer):
                h.update(view[:n])
    except OSError as exc:
        raise ModelError(f"cannot read ({exc.strerror})", path) from None
    return h.hexdigest()


def read_checksums(folder: str | Path, info: ContainerInfo) -> np.ndarray | None:
    """experts.xxh as uint64 [n_layers, n_experts], checked against the manifest; None without checksums."""
    if not info.has_checksums:
        return None
    path = Path(folder) / CHECKSUM_FILE
    want = info.n_layers * info.n_experts * 8
    try:
        size = path.stat().st_size
        if size != want:
            raise ModelError(f"has {size} bytes, the manifest implies {want} ({info.n_layers} x {info.n_experts} checksums)", path)
        data = path.read_bytes()
    except FileNotFoundError:
        raise ModelError(f"missing (the manifest names {CHECKSUM_KIND} checksums)", path) from None
    except OSError as exc:
        raise ModelError(f"cannot read ({exc.strerror})", path) from None
    if xxhash.xxh3_64_hexdigest(data) != info.checksum_file_hash:
        raise ModelError(f"does not match its checksum in {CONTAINER_JSON} (the file is damaged)", path)
    return np.frombuffer(data, dtype="<u8").reshape(info.n_layers, info.n_experts).copy()


def new_container_info(bits: int, n_layers: int, n_experts: int, hidden: int, inter: int, source: str = "",
                       prefix: str = "", dense_bits: int = 0) -> ContainerInfo:
    """The manifest of a container of that shape: layers one after another, blobs
    `blob_stride` apart (no checksums yet: ExpertBlobWriter.finish adds them)."""
    layout = BlobLayout(quant_kind(bits), hidden, inter)
    offsets = [layer * layout.stride * n_experts for layer in range(n_layers)]
    return ContainerInfo(bits, GROUP, n_layers, n_experts, hidden, inter, layout.nbytes, layout.stride,
                         offsets, source, prefix, dense_bits)


class ExpertBlobWriter:
    """Writes experts.bin blob by blob, with each blob's checksum, for any container writer.

    The one way a container's experts are written (convert, make-synthetic), so
    every container has the same layout and checksums::

        info = new_container_info(bits, n_layers, n_experts, hidden, inter, source, prefix)
        with ExpertBlobWriter(folder, info) as w:
            for layer ...: for expert ...: w.add(layer, expert, blob)
        info = w.info                                 # finish() filled the checksum fields
        write_manifest(folder, info)                  # after dense.safetensors is written

    add() takes the blob bytes (exactly blob_nbytes, any buffer) in any order and
    writes them at their offset; finish() checks every blob was added, pads
    experts.bin to its full size, writes experts.xxh (raw little-endian uint64
    [n_layers, n_experts]) and returns `info` with `checksum` and
    `checksum_file_hash` set. Leaving the `with` block calls finish() unless it
    raised; the writer never removes files (the caller's partial folder does).
    """

    def __init__(self, folder: str | Path, info: ContainerInfo) -> None:
        self.folder = Path(folder)
        self.info = info
        self._sums = np.zeros((info.n_layers, info.n_experts), dtype="<u8")
        self._added = np.zeros((info.n_layers, info.n_experts), dtype=bool)
        self._file = open(self.folder / EXPERTS_BIN, "wb")
        self._done = False

    def add(self, layer: int, expert: int, blob) -> None:
        """Write one expert's blob (blob_nbytes bytes) and record its checksum."""
        info = self.info
        if not (0 <= layer < info.n_layers and 0 <= expert < info.n_experts):
            raise IndexError(f"expert ({layer}, {expert}) outside {info.n_layers} layers x {info.n_experts} experts")
        view = memoryview(blob).cast("B")
        if len(view) != info.blob_nbytes:
            raise ValueError(f"blob of {len(view)} bytes, the container's blobs have {info.blob_nbytes}")
        self._sums[layer, expert] = blob_hash(view)
        self._file.seek(info.blob_offset(layer, expert))
        self._file.write(view)
        self._added[layer, expert] = True

    def finish(self) -> ContainerInfo:
        """Close experts.bin at its full size and write experts.xxh; returns the info with checksums."""
        if self._done:
            return self.info
        missing = np.argwhere(~self._added)
        if len(missing):
            layer, expert = missing[0]
            self._file.close()
            raise ModelError(f"{len(missing)} blobs were never written, the first ({layer}, {expert})",
                             self.folder / EXPERTS_BIN)
        self._file.truncate(self.info.experts_file_nbytes)
        self._file.close()
        data = self._sums.tobytes()
        with open(self.folder / CHECKSUM_FILE, "wb") as f:
            f.write(data)
        self._done = True
        self.info = replace(self.info, checksum=CHECKSUM_KIND, checksum_file_hash=xxhash.xxh3_64_hexdigest(data),
                            version=FORMAT_VERSION)
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
    """Hash dense.safetensors into `info` (when it has checksums) and write tierlab_container.json."""
    folder = Path(folder)
    if info.has_checksums:
        info = replace(info, dense_hash=file_hash(folder / DENSE_FILE))
    write_atomic(folder / CONTAINER_JSON, json.dumps(info.to_json(), indent=1) + "\n")
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
        problem = None
        if size < self.info.experts_nbytes:
            problem = f"truncated: {size} bytes, the container needs {self.info.experts_nbytes}"
        elif size > self.info.experts_file_nbytes:
            problem = f"has {size} bytes, more than the {self.info.experts_file_nbytes} the manifest implies"
        try:
            if problem:
                raise ModelError(problem, path)
            #: per-blob checksums (None: a version 1 container, nothing to verify)
            self.checksums = read_checksums(self.folder, self.info)
        except BaseException:
            os.close(self._fd)
            self._fd = -1
            raise
        #: which blobs this process has read and found intact (each is hashed once)
        self.verified = np.zeros((self.n_layers, self.n_experts), dtype=bool)

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
        if self.checksums is not None and not self.verified[layer, expert]:
            if blob_hash(view) != int(self.checksums[layer, expert]):
                raise ChecksumMismatch(self.folder / EXPERTS_BIN, layer, expert)
            self.verified[layer, expert] = True

    def expert_ranges(self) -> list[FileRange]:
        """Where the experts' bytes lie: all of experts.bin (for the read-ahead at load)."""
        return [FileRange(self.folder / EXPERTS_BIN, 0, self.info.experts_nbytes)]

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


@dataclass(frozen=True)
class VerifyReport:
    """What verify_container found: the damaged blobs, and whether the dense file matches."""

    blobs: int
    damaged: list[tuple[int, int]]
    dense_ok: bool


def verify_container(folder: str | Path, progress: Callable[[int, int], None] | None = None) -> VerifyReport | None:
    """Hash every blob and dense.safetensors against the manifest; None for a container without checksums.

    Reads one blob at a time (memory is one blob); progress(done, n_layers) after each layer.
    """
    folder = Path(folder)
    info = read_container_info(folder)
    if not info.has_checksums:
        return None
    damaged = []
    with ContainerExpertSource(folder) as src:
        slot = np.empty(info.blob_nbytes, dtype=np.uint8)
        for layer in range(info.n_layers):
            for expert in range(info.n_experts):
                try:
                    src.read(layer, expert, slot)
                except ChecksumMismatch:
                    damaged.append((layer, expert))
            if progress:
                progress(layer + 1, info.n_layers)
    dense_ok = file_hash(folder / DENSE_FILE) == info.dense_hash
    return VerifyReport(info.n_layers * info.n_experts, damaged, dense_ok)


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
        with ExpertBlobWriter(tmp, info) as writer:
            for layer in range(cfg.n_layers):
                for expert in range(cfg.n_experts):
                    writer.add(layer, expert, build_blob_fast(*ckpt.read_expert(layer, expert), bits))
                if progress:
                    progress(layer + 1, total, f"layer {layer + 1}/{cfg.n_layers}")
        write_dense(ckpt, tmp / DENSE_FILE, dense_bits=dense_bits)
        for name in COPIED_FILES:
            if (model_dir / name).is_file():
                shutil.copy2(model_dir / name, tmp / name)
        info = write_manifest(tmp, writer.info)
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
