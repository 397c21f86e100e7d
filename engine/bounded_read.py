"""Reading an input file only if it is a regular file of a size it can plausibly have.

A FIFO, a socket, a character device (`/dev/zero`) or a directory named
where a model file, a heat profile, a log or a reference belongs must be
refused at once, not read (a FIFO blocks, `/dev/zero` never ends). Every
path is opened with O_NONBLOCK, so naming a FIFO cannot block, and checked
with fstat on the open descriptor, so what is read is what was checked.
Each kind of file has a byte limit proportionate to what it can hold
(`LIMITS`); a larger file is refused before any of it is read.
"""

from __future__ import annotations

import contextlib
import os
import stat
from typing import BinaryIO, Iterator

from tierlab.engine.errors import TierlabError

MiB = 1 << 20

#: the most bytes each kind of input may have (docs/formats.md "Limits")
LIMITS = {
    "config.json": 4 * MiB,
    "tokenizer.json": 64 * MiB,
    "tokenizer_config.json": 64 * MiB,
    "chat template": 4 * MiB,
    "safetensors index": 64 * MiB,
    "reference": 64 * MiB,
}
#: the longest line a session log may have (one token record of a large model is well under it)
LOG_LINE_LIMIT = MiB


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a FIFO (named pipe)"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode):
        return "a character device"
    if stat.S_ISBLK(mode):
        return "a block device"
    return "not a regular file"


def open_regular(path: str | os.PathLike, what: str, error: type[TierlabError] = TierlabError,
                 limit: int | None = None) -> tuple[int, int]:
    """An open read-only descriptor of `path` and its size, or `error` in one line.

    Refuses anything but a regular file, and a file larger than `limit` bytes.
    The caller closes the descriptor.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise error(f"cannot read {what}: not found", path) from None
    except OSError as exc:
        raise error(f"cannot open {what}: {exc.strerror or exc}", path) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise error(f"{what} is {_kind(st.st_mode)}, not a regular file", path)
        if limit is not None and st.st_size > limit:
            raise error(f"{what} is {st.st_size} bytes, more than the {limit} a {what} may have", path)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd, st.st_size


def read_regular(path: str | os.PathLike, limit: int, what: str, error: type[TierlabError] = TierlabError) -> bytes:
    """The whole of a regular file of at most `limit` bytes; anything else is `error` in one line."""
    fd, size = open_regular(path, what, error, limit)
    try:
        chunks, total = [], 0
        while True:  # to the end (a file may grow meanwhile: never past the limit)
            chunk = os.read(fd, min(max(size - total, 0), 64 * MiB) + 1)
            if not chunk:
                break
            total += len(chunk)
            if total > limit:
                raise error(f"{what} grew past the {limit} bytes a {what} may have", path)
            chunks.append(chunk)
    except OSError as exc:
        raise error(f"cannot read {what}: {exc.strerror or exc}", path) from None
    finally:
        os.close(fd)
    return b"".join(chunks)


def read_text(path: str | os.PathLike, what: str, error: type[TierlabError] = TierlabError,
              limit: int | None = None) -> str:
    """A UTF-8 text file of kind `what` (its limit from LIMITS unless given)."""
    data = read_regular(path, LIMITS[what] if limit is None else limit, what, error)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise error(f"{what} is not UTF-8 text (byte {exc.start})", path) from None


@contextlib.contextmanager
def open_binary(path: str | os.PathLike, what: str, error: type[TierlabError] = TierlabError,
                limit: int | None = None) -> Iterator[BinaryIO]:
    """A buffered binary reader over a checked regular file (for line-by-line or header reads)."""
    fd, _ = open_regular(path, what, error, limit)
    handle = os.fdopen(fd, "rb")
    with handle:
        yield handle


def check_regular(path: str | os.PathLike, what: str, error: type[TierlabError] = TierlabError,
                  limit: int | None = None) -> int:
    """The size of `path` if it is a regular file within `limit`, for readers that open it themselves."""
    fd, size = open_regular(path, what, error, limit)
    os.close(fd)
    return size


def read_line(handle: BinaryIO, limit: int = LOG_LINE_LIMIT, skip: bool = True) -> tuple[bytes, bool]:
    """The next line (with its newline) and whether it fits the limit; at most limit+1 bytes are held.

    A longer line comes back as its first `limit` bytes with False; with `skip`
    the rest of it is passed over in bounded pieces (never held whole) so that
    the next call reads the next line, without it the reader stops there.
    """
    line = handle.readline(limit + 1)
    if len(line) <= limit:
        return line, True
    rest = line
    while skip and rest and not rest.endswith(b"\n"):
        rest = handle.readline(MiB)
    return line[:limit], False
