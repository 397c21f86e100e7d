"""Reading and writing safetensors files, with checks that fail in one line.

We parse the header ourselves rather than through the `safetensors` package
because the expert store needs each tensor's absolute byte range to read one
expert with a positional read, and because an untrusted checkpoint must be
refused with a message that names the file and the problem. The writer
streams: the header first, then one tensor at a time, so that writing a file
never holds more than one of its tensors in memory.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import numpy as np

from tierlab.engine import hugepages
from tierlab.engine.errors import ModelError

# safetensors dtype name -> (numpy storage dtype, bytes per element).
# bf16 is kept as its raw uint16 bit pattern; kernels widen it exactly.
DTYPES = {
    "F32": (np.dtype("<f4"), 4),
    "F16": (np.dtype("<f2"), 2),
    "BF16": (np.dtype("<u2"), 2),
    "F64": (np.dtype("<f8"), 8),
    "I64": (np.dtype("<i8"), 8),
    "I32": (np.dtype("<i4"), 4),
    "I16": (np.dtype("<i2"), 2),
    "I8": (np.dtype("i1"), 1),
    "U8": (np.dtype("u1"), 1),
    "BOOL": (np.dtype("u1"), 1),
}
MAX_HEADER = 100 * 1024 * 1024
HEADER_ALIGN = 8  # the JSON header is padded with spaces so that the data starts 8-byte aligned


def dtype_name(arr: np.ndarray) -> str:
    """The safetensors dtype name of an array in storage form (uint16 is bf16, as read_tensor returns it)."""
    if arr.dtype == np.bool_:
        return "BOOL"
    for name, (np_dtype, _) in DTYPES.items():
        if name != "BOOL" and arr.dtype == np_dtype:
            return name
    raise ValueError(f"no safetensors dtype for numpy {arr.dtype}")


@dataclass(frozen=True)
class TensorInfo:
    name: str
    path: Path
    dtype: str  # safetensors name: F32, BF16, F16, ...
    shape: tuple[int, ...]
    offset: int  # absolute byte offset in the file
    nbytes: int

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


def read_header(path: Path) -> dict[str, TensorInfo]:
    """Parse and validate one file's header; every range must lie inside the file."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ModelError(f"truncated safetensors file ({size} bytes, no header)", path)
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER or 8 + n > size:
                raise ModelError(f"truncated or corrupt safetensors header (claims {n} bytes, file has {size})", path)
            blob = f.read(n)
    except OSError as exc:
        raise ModelError(f"cannot read: {exc.strerror or exc}", path) from None
    try:
        header = json.loads(blob.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise ModelError("corrupt safetensors header (not JSON)", path) from None
    if not isinstance(header, dict):
        raise ModelError("corrupt safetensors header (not a JSON object)", path)
    data_start = 8 + n
    data_len = size - data_start
    tensors: dict[str, TensorInfo] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = entry["dtype"]
            shape = tuple(int(d) for d in entry["shape"])
            begin, end = (int(v) for v in entry["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise ModelError(f"tensor {name}: malformed header entry", path) from None
        if dtype not in DTYPES:
            raise ModelError(f"tensor {name}: unsupported dtype {dtype}", path)
        if any(d < 0 for d in shape):
            raise ModelError(f"tensor {name}: negative dimension in shape {list(shape)}", path)
        numel = 1
        for d in shape:
            numel *= d
        if not 0 <= begin <= end or end - begin != numel * DTYPES[dtype][1]:
            raise ModelError(f"tensor {name}: byte range {begin}..{end} does not match shape {list(shape)} {dtype}", path)
        if end > data_len:
            raise ModelError(
                f"tensor {name}: data ends at byte {data_start + end} but the file has {size} (truncated?)", path
            )
        tensors[name] = TensorInfo(name, path, dtype, shape, data_start + begin, end - begin)
    return tensors


def read_tensor(info: TensorInfo) -> np.ndarray:
    """Read a whole tensor into memory in its storage dtype (bf16 as uint16)."""
    np_dtype, _ = DTYPES[info.dtype]
    out = hugepages.empty(info.shape, np_dtype)
    read_into(info.path, info.offset, out.reshape(-1).view(np.uint8))
    return out


def read_into(path: Path, offset: int, out: np.ndarray) -> None:
    """Fill a contiguous uint8 buffer from `path` at `offset` with positional reads."""
    view = memoryview(out)
    fd = os.open(path, os.O_RDONLY)
    try:
        done = 0
        total = len(view)
        while done < total:
            got = os.preadv(fd, [view[done:]], offset + done)
            if got <= 0:
                raise ModelError(f"unexpected end of file at byte {offset + done}", path)
            done += got
    except OSError as exc:
        raise ModelError(f"read failed: {exc.strerror or exc}", path) from None
    finally:
        os.close(fd)


class FileHandles:
    """Keeps one open descriptor per shard, so expert reads are a single pread each."""

    def __init__(self) -> None:
        self._fds: dict[Path, int] = {}

    def fd(self, path: Path) -> int:
        fd = self._fds.get(path)
        if fd is None:
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError as exc:
                raise ModelError(f"cannot open: {exc.strerror or exc}", path) from None
            self._fds[path] = fd
        return fd

    def pread_into(self, path: Path, offset: int, out: memoryview) -> None:
        fd = self.fd(path)
        done = 0
        total = len(out)
        while done < total:
            try:
                got = os.preadv(fd, [out[done:]], offset + done)
            except OSError as exc:
                raise ModelError(f"read failed: {exc.strerror or exc}", path) from None
            if got <= 0:
                raise ModelError(f"unexpected end of file at byte {offset + done}", path)
            done += got

    def close(self) -> None:
        for fd in self._fds.values():
            try:
                os.close(fd)
            except OSError:
                pass
        self._fds.clear()


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of a file to be written: its name, safetensors dtype and shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = DTYPES[self.dtype][1]
        for d in self.shape:
            n *= d
        return n


def write_file(path: Path, specs: list[TensorSpec], arrays: Iterable[np.ndarray],
               metadata: dict[str, str] | None = None) -> int:
    """Write `arrays` (one per spec, in spec order, produced lazily) as one safetensors file.

    Returns the number of data bytes. An array whose byte count does not match
    its spec is refused with a ValueError before it is written.
    """
    header, offset = {}, 0
    for spec in specs:
        if spec.dtype not in DTYPES:
            raise ValueError(f"tensor {spec.name}: unsupported dtype {spec.dtype}")
        header[spec.name] = {"dtype": spec.dtype, "shape": list(spec.shape), "data_offsets": [offset, offset + spec.nbytes]}
        offset += spec.nbytes
    if metadata is not None:
        header["__metadata__"] = metadata
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % HEADER_ALIGN)
    written = 0
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for spec, arr in zip(specs, arrays):
            data = np.ascontiguousarray(arr)
            if data.nbytes != spec.nbytes:
                raise ValueError(f"tensor {spec.name}: {data.nbytes} bytes for {spec.dtype} {list(spec.shape)}")
            f.write(memoryview(data.reshape(-1)).cast("B") if data.nbytes else b"")
            written += 1
            del arr, data  # one tensor alive at a time: the next is made after this one is gone
    if written != len(specs):
        raise ValueError(f"{path}: {written} of {len(specs)} tensors were given")
    return offset
