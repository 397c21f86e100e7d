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
from tierlab.engine.bounded_read import open_regular
from tierlab.engine.errors import ModelError
from tierlab.engine.finite import require_finite

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


def _no_duplicates(pairs: list[tuple[str, object]]) -> dict:
    """json object hook: a name defined twice is refused, not silently overwritten."""
    out: dict = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateName(key)
        out[key] = value
    return out


class _DuplicateName(ValueError):
    pass


def _short(name: str) -> str:
    return name if len(name) <= 80 else name[:77] + "..."


def read_header(path: Path) -> dict[str, TensorInfo]:
    """Parse and validate one file's header: each tensor's dtype, shape and byte range agree,
    every range lies inside the file, no two ranges overlap and no name is defined twice."""
    fd, size = open_regular(path, "safetensors file", ModelError)
    try:
        head = os.pread(fd, 8, 0)
        if len(head) < 8:
            raise ModelError(f"truncated safetensors file ({size} bytes, no header)", path)
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER or 8 + n > size:
            raise ModelError(f"truncated or corrupt safetensors header (claims {n} bytes, file has {size}; "
                             f"at most {MAX_HEADER})", path)
        blob = os.pread(fd, n, 8)
        if len(blob) < n:
            raise ModelError(f"short read of the safetensors header ({len(blob)} of {n} bytes)", path)
    except OSError as exc:
        raise ModelError(f"cannot read: {exc.strerror or exc}", path) from None
    finally:
        os.close(fd)
    try:
        text = blob.decode("utf-8")
        header = json.loads(text)
        if isinstance(header, dict) and text.count('"data_offsets"') != len(header) - ("__metadata__" in header):
            header = json.loads(text, object_pairs_hook=_no_duplicates)  # the slow parse names the duplicate
    except _DuplicateName as exc:
        raise ModelError(f"safetensors header defines {_short(str(exc))} twice", path) from None
    except RecursionError:
        raise ModelError("corrupt safetensors header (nested too deeply)", path) from None
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
        shown = _short(name)
        try:
            dtype = entry["dtype"]
            shape = tuple(_dim(d) for d in entry["shape"])
            begin, end = (_dim(v) for v in entry["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise ModelError(f"tensor {shown}: malformed header entry", path) from None
        if not isinstance(dtype, str) or dtype not in DTYPES:
            raise ModelError(f"tensor {shown}: unsupported dtype {_short(str(dtype))}", path)
        if len(shape) > MAX_RANK:
            raise ModelError(f"tensor {shown}: {len(shape)} dimensions (at most {MAX_RANK})", path)
        numel = 1
        for d in shape:
            numel *= d
        if not begin <= end or end - begin != numel * DTYPES[dtype][1]:
            raise ModelError(f"tensor {shown}: byte range {begin}..{end} does not match shape {list(shape)} {dtype}",
                             path)
        if end > data_len:
            raise ModelError(
                f"tensor {shown}: data ends at byte {data_start + end} but the file has {size} (truncated?)", path
            )
        tensors[name] = TensorInfo(name, path, dtype, shape, data_start + begin, end - begin)
    _check_layout(tensors, data_start, size, path)
    return tensors


#: more dimensions than any weight has: a header claiming them is corrupt
MAX_RANK = 8


def _dim(value) -> int:
    """A non-negative integer from a header (a float, bool, string or negative value is malformed)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(value)
    return value


def _check_layout(tensors: dict[str, TensorInfo], data_start: int, size: int, path: Path) -> None:
    """Two tensors sharing bytes would alias each other's weights, and bytes no tensor owns mean
    the header and the data disagree (a shifted header length, a spliced file): refuse both.
    The format lays tensors end to end from the start of the data to the end of the file."""
    ranges = sorted((info.offset, info.offset + info.nbytes, name) for name, info in tensors.items() if info.nbytes)
    for (_, end_a, name_a), (begin_b, _, name_b) in zip(ranges, ranges[1:]):
        if begin_b < end_a:
            raise ModelError(f"tensors {_short(name_a)} and {_short(name_b)} overlap (bytes {begin_b}..{end_a})", path)
    at = data_start
    for begin, end, name in ranges:
        if begin != at:
            raise ModelError(f"bytes {at}..{begin} before tensor {_short(name)} belong to no tensor", path)
        at = end
    if at != size:
        raise ModelError(f"bytes {at}..{size} at the end belong to no tensor (header and data disagree)", path)


def read_tensor(info: TensorInfo) -> np.ndarray:
    """Read a whole tensor into memory in its storage dtype (bf16 as uint16); a float tensor
    holding NaN or infinity is refused here, once, at load."""
    np_dtype, _ = DTYPES[info.dtype]
    out = hugepages.empty(info.shape, np_dtype)
    read_into(info.path, info.offset, out.reshape(-1).view(np.uint8))
    require_finite(out, info.dtype, f"tensor {info.name}", info.path)
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
