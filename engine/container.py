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
import struct
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from tierlab.engine.errors import ModelError
from tierlab.engine.kernels import qmatvec
from tierlab.engine.quant import BLOB_ALIGN, GROUP, BlobLayout, build_blob_fast, check_dims

CONTAINER_JSON = "tierlab_container.json"
EXPERTS_BIN = "experts.bin"
DENSE_FILE = "dense.safetensors"
FORMAT_NAME = "tierlab-experts"
FORMAT_VERSION = 1
COPIED_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")
IGNORED_PREFIXES = ("model.visual.", "mtp.", "model.mtp.")


def blob_nbytes_for(kind: str, hidden: int, inter: int) -> int:
    """Bytes of one expert blob of a kind (fp32/bf16 raw, int8/int4 container)."""
    if kind in ("fp32", "bf16"):
        return qmatvec.raw_blob_nbytes(kind, hidden, inter)
    return BlobLayout({"int8": 8, "int4": 4}[kind], hidden, inter).nbytes


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
        return f"int{self.bits}"

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
    layout = BlobLayout(bits, hidden, inter)
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


# --- reading a Hugging Face checkpoint ------------------------------------------------------


@dataclass(frozen=True)
class MoeDims:
    n_layers: int
    n_experts: int
    hidden: int
    inter: int
    top_k: int
    architecture: str


def read_moe_dims(model_dir: str | Path) -> MoeDims:
    """MoE sizes from config.json (flat or nested under text_config)."""
    path = Path(model_dir) / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except FileNotFoundError:
        raise ModelError("missing config.json", path) from None
    except (OSError, ValueError) as exc:
        raise ModelError(f"unreadable config ({str(exc).splitlines()[0]})", path) from None
    text = cfg.get("text_config") or cfg
    arch = cfg.get("model_type") or text.get("model_type") or "?"
    try:
        n_experts = text.get("num_experts", text.get("num_local_experts"))
        return MoeDims(
            int(text["num_hidden_layers"]), int(n_experts), int(text["hidden_size"]),
            int(text["moe_intermediate_size"]), int(text.get("num_experts_per_tok", 0)), str(arch),
        )
    except (KeyError, TypeError, ValueError):
        raise ModelError(
            "not a MoE config (needs num_hidden_layers, num_experts or num_local_experts, hidden_size, moe_intermediate_size)",
            path,
        ) from None


class Checkpoint:
    """Tensor names of a safetensors checkpoint (single file or sharded) and lazy reads."""

    def __init__(self, model_dir: str | Path) -> None:
        import ml_dtypes  # noqa: F401  (registers bfloat16 so safetensors' numpy reader can return it)
        from safetensors import safe_open

        self.dir = Path(model_dir)
        self._open = safe_open
        self._handles: dict[Path, object] = {}
        index = self.dir / "model.safetensors.index.json"
        self.file_of: dict[str, Path] = {}
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (OSError, ValueError, KeyError) as exc:
                raise ModelError(f"unreadable shard index ({exc})", index) from None
            self.file_of = {name: self.dir / fname for name, fname in weight_map.items()}
        else:
            files = sorted(self.dir.glob("*.safetensors"))
            if not files:
                raise ModelError("no *.safetensors files", self.dir)
            for f in files:
                for name in self._handle(f).keys():
                    self.file_of[name] = f

    def _handle(self, path: Path):
        if path not in self._handles:
            try:
                self._handles[path] = self._open(str(path), framework="np")
            except FileNotFoundError:
                raise ModelError("missing shard", path) from None
            except Exception as exc:  # safetensors raises its own error types
                raise ModelError(f"unreadable safetensors ({str(exc).splitlines()[0]})", path) from None
        return self._handles[path]

    def names(self) -> list[str]:
        return list(self.file_of)

    def tensor(self, name: str) -> np.ndarray:
        return self._handle(self.file_of[name]).get_tensor(name)

    def slice(self, name: str):
        """A lazy slice object: slice(name)[e] reads only expert e."""
        return self._handle(self.file_of[name]).get_slice(name)

    def dtype_shape(self, name: str) -> tuple[str, list[int]]:
        s = self.slice(name)
        return s.get_dtype(), list(s.get_shape())

    def close(self) -> None:
        self._handles.clear()


_EXPERT_RE = re.compile(r"^(?P<prefix>.*?)layers\.(?P<layer>\d+)\.mlp\.experts\.(?P<rest>.+)$")


def is_ignored(name: str) -> bool:
    return name.startswith(IGNORED_PREFIXES)


def find_layer_prefix(names: list[str]) -> str:
    """The text model's prefix (`model.` or `model.language_model.`), from the expert tensors."""
    prefixes = {m["prefix"] for n in names if not is_ignored(n) and (m := _EXPERT_RE.match(n))}
    if len(prefixes) != 1:
        raise ModelError(f"expected expert tensors under one prefix, found {sorted(prefixes) or 'none'}")
    return prefixes.pop()


class ExpertReader:
    """Yields (gate [I,H], up [I,H], down [H,I]) per expert, for either expert layout."""

    def __init__(self, ckpt: Checkpoint, prefix: str, dims: MoeDims) -> None:
        self.ckpt, self.prefix, self.dims = ckpt, prefix, dims

    def _name(self, layer: int, rest: str) -> str:
        return f"{self.prefix}layers.{layer}.mlp.experts.{rest}"

    def _fused_name(self, layer: int, what: str) -> str | None:
        for name in (self._name(layer, what), self._name(layer, what + ".weight")):
            if name in self.ckpt.file_of:
                return name
        return None

    def layer(self, layer: int) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        d = self.dims
        gate_up = self._fused_name(layer, "gate_up_proj")
        if gate_up is not None:
            down = self._fused_name(layer, "down_proj")
            if down is None:
                raise ModelError(f"layer {layer} has fused gate_up_proj but no down_proj", self.ckpt.dir)
            gu_slice, d_slice = self.ckpt.slice(gate_up), self.ckpt.slice(down)
            self._check_shape(gate_up, gu_slice.get_shape(), [d.n_experts, 2 * d.inter, d.hidden])
            self._check_shape(down, d_slice.get_shape(), [d.n_experts, d.hidden, d.inter])
            for e in range(d.n_experts):
                gu = gu_slice[e : e + 1][0]
                yield gu[: d.inter], gu[d.inter :], d_slice[e : e + 1][0]
            return
        for e in range(d.n_experts):
            mats = []
            for proj, shape in (("gate_proj", [d.inter, d.hidden]), ("up_proj", [d.inter, d.hidden]), ("down_proj", [d.hidden, d.inter])):
                name = self._name(layer, f"{e}.{proj}.weight")
                if name not in self.ckpt.file_of:
                    raise ModelError(f"missing tensor {name}", self.ckpt.dir)
                t = self.ckpt.tensor(name)
                self._check_shape(name, list(t.shape), shape)
                mats.append(t)
            yield tuple(mats)

    def _check_shape(self, name: str, got: list[int], want: list[int]) -> None:
        if list(got) != want:
            raise ModelError(f"tensor {name} has shape {list(got)}, config implies {want}", self.ckpt.dir)


# --- writing ---------------------------------------------------------------------------------

_ST_DTYPES = {"BF16": 2, "F16": 2, "F32": 4, "F64": 8, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}


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
    """One tensor of dense.safetensors: a copy of `source`, or its qweight / qscales part."""

    name: str
    dtype: str
    shape: list[int]
    source: str
    part: str = "copy"  # "copy" | "qweight" | "qscales"


def quantises(name: str, dtype: str, shape: list[int], dense_bits: int) -> bool:
    """Whether `convert --dense-bits` stores this dense tensor quantised."""
    return (bool(dense_bits) and _QUANT_DENSE_RE.search(name) is not None and dtype in _QUANT_SOURCE_DTYPES
            and len(shape) == 2 and shape[1] % GROUP == 0 and shape[0] > 0)


def _dense_plan(ckpt: Checkpoint, dense_bits: int = 0) -> list[DenseEntry]:
    """Every tensor of dense.safetensors, in source name order."""
    plan = []
    for name in sorted(ckpt.names()):
        if is_ignored(name) or _EXPERT_RE.match(name):
            continue
        dtype, shape = ckpt.dtype_shape(name)
        if quantises(name, dtype, shape, dense_bits):
            rows, cols = shape
            plan.append(DenseEntry(name + ".qweight", "I8" if dense_bits == 8 else "U8",
                                   [rows, cols if dense_bits == 8 else cols // 2], name, "qweight"))
            plan.append(DenseEntry(name + ".qscales", "F32", [rows, cols // GROUP], name, "qscales"))
        else:
            plan.append(DenseEntry(name, "BF16" if dtype == "F32" else dtype, shape, name))
    return plan


def _entry_array(ckpt: Checkpoint, entry: DenseEntry, dense_bits: int, memo: dict) -> np.ndarray:
    """The bytes of one plan entry; a quantised matrix is computed once for its two parts."""
    import ml_dtypes

    if entry.part == "copy":
        t = ckpt.tensor(entry.source)
        if t.dtype == np.float32 and entry.dtype == "BF16":
            t = t.astype(ml_dtypes.bfloat16)
        return t
    if memo.get("source") != entry.source:
        from tierlab.engine.qlinear import quantize_matrix

        memo["source"], memo["matrix"] = entry.source, quantize_matrix(ckpt.tensor(entry.source), dense_bits)
    m = memo["matrix"]
    return m.q if entry.part == "qweight" else m.scales


def write_dense(ckpt: Checkpoint, path: Path, progress: Callable[[str], None] | None = None,
                dense_bits: int = 0) -> int:
    """Stream every non-expert tensor into one safetensors file; returns its data bytes.

    Written by hand (header, then tensors one at a time) so that peak memory is
    one tensor, not the whole embedding + lm_head. With dense_bits 8 or 4 the
    projections `quantises()` names are stored as `<name>.qweight` (I8, or U8
    planar nibbles) and `<name>.qscales` (F32), as in docs/formats.md.
    """
    plan = _dense_plan(ckpt, dense_bits)
    header, offset = {}, 0
    for e in plan:
        name, dtype, shape = e.name, e.dtype, e.shape
        if dtype not in _ST_DTYPES:
            raise ModelError(f"tensor {name} has unsupported dtype {dtype}", ckpt.dir)
        n = int(np.prod(shape, dtype=np.int64)) * _ST_DTYPES[dtype]
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    header["__metadata__"] = {"format": "pt", "writer": "tierlab convert", "dense_bits": str(dense_bits)}
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    memo: dict = {}
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for e in plan:
            f.write(np.ascontiguousarray(_entry_array(ckpt, e, dense_bits, memo)).tobytes())
            if progress:
                progress(e.name)
    return offset


def _check_out_dir(out: Path, force: bool, model_dir: Path) -> None:
    src, dst = model_dir.resolve(), out.resolve()
    if dst == src or dst in src.parents or src in dst.parents:
        raise ModelError("the output folder must not be, contain or sit inside the model folder", out)
    if out.exists() and not out.is_dir():
        raise ModelError("exists and is not a folder", out)
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ModelError("exists and is not empty (use --force to overwrite)", out)


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
    dims = read_moe_dims(model_dir)
    try:
        check_dims(dims.hidden, dims.inter, group)
    except ValueError as exc:
        raise ModelError(str(exc), model_dir / "config.json") from None
    _check_out_dir(out, force, model_dir)
    ckpt = Checkpoint(model_dir)
    prefix = find_layer_prefix(ckpt.names())
    reader = ExpertReader(ckpt, prefix, dims)
    layout = BlobLayout(bits, dims.hidden, dims.inter)
    layer_bytes = layout.stride * dims.n_experts
    offsets = [layer * layer_bytes for layer in range(dims.n_layers)]
    info = ContainerInfo(
        bits, group, dims.n_layers, dims.n_experts, dims.hidden, dims.inter, layout.nbytes, layout.stride,
        offsets, str(model_dir.resolve()), prefix, dense_bits,
    )

    tmp = out.with_name(out.name + ".partial")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    total = dims.n_layers + 1
    try:
        pad = np.zeros(layout.stride - layout.nbytes, dtype=np.uint8)
        with open(tmp / EXPERTS_BIN, "wb") as f:
            for layer in range(dims.n_layers):
                for gate, up, down in reader.layer(layer):
                    f.write(build_blob_fast(gate, up, down, bits).tobytes())
                    f.write(pad.tobytes())
                if progress:
                    progress(layer + 1, total, f"layer {layer + 1}/{dims.n_layers}")
        write_dense(ckpt, tmp / DENSE_FILE, dense_bits=dense_bits)
        for name in COPIED_FILES:
            if (model_dir / name).is_file():
                shutil.copy2(model_dir / name, tmp / name)
        (tmp / CONTAINER_JSON).write_text(json.dumps(info.to_json(), indent=1) + "\n")
        if progress:
            progress(total, total, "dense tensors")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        ckpt.close()
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return info
