"""Reading the experts into the page cache while the model loads.

Why: on a cold page cache (after a reboot, or after other files pushed the
model out) the first prompt reads every expert it routes to from the disk,
one `pread` at a time, after "ready": 18 s for the 4-layer slice's 430 MB on
a VM disk that reads 30 MB/s (docs/benchmarks.md, First token). When the
experts fit comfortably in the memory the machine has free, the kernel is
asked to read them (`POSIX_FADV_WILLNEED`) from a background thread, so the
disk works during the kernel warm-up and while the user types the first
prompt. The advice only fills the page cache: nothing is read into the
process, and a prompt that needs an expert before it arrives reads it as it
would have. Experts bigger than half the free memory are left alone: they
would only push other files out of the page cache.
"""

from __future__ import annotations

import itertools
import os
import threading
from dataclasses import dataclass
from pathlib import Path

from tierlab.engine import budget

SHARE_OF_FREE = 0.5  # read ahead only when the experts take at most this share of the free memory


@dataclass(frozen=True)
class FileRange:
    """Bytes [offset, offset + length) of one file."""

    path: Path
    offset: int
    length: int


def merged(ranges: list[FileRange]) -> list[FileRange]:
    """The ranges per file in file order, touching or overlapping ones joined: one advice per
    run of experts instead of one per tensor."""
    out: list[FileRange] = []
    for r in sorted(ranges, key=lambda r: (str(r.path), r.offset)):
        last = out[-1] if out else None
        if last is not None and last.path == r.path and r.offset <= last.offset + last.length:
            end = max(last.offset + last.length, r.offset + r.length)
            out[-1] = FileRange(last.path, last.offset, end - last.offset)
        elif r.length > 0:
            out.append(r)
    return out


def worth_reading(nbytes: int, free: int | None) -> bool:
    """Whether `nbytes` of experts should be read ahead with `free` bytes of memory free."""
    return free is not None and 0 < nbytes <= SHARE_OF_FREE * free


def start(ranges: list[FileRange], free: int | None = None) -> threading.Thread | None:
    """Advise the kernel to read `ranges` in a daemon thread (the advice can block while the
    disk queue is full); None when they are too big for the free memory, or the platform
    has no posix_fadvise. Each file is opened anew, so closing the model never leaves the
    thread with a descriptor that another file now uses."""
    advise = getattr(os, "posix_fadvise", None)
    ranges = merged(ranges)
    free = budget.auto_budget() if free is None else free
    if advise is None or not worth_reading(sum(r.length for r in ranges), free):
        return None

    def run() -> None:
        for path, group in itertools.groupby(ranges, key=lambda r: r.path):  # merged: file by file
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError:
                continue  # the load itself reports unreadable files
            try:
                size = os.fstat(fd).st_size
                for r in group:  # a range to the end of the file is advised as such (length 0):
                    # the kernel then reads its last page too, which it leaves out otherwise
                    length = 0 if r.offset + r.length >= size else r.length
                    advise(fd, r.offset, length, os.POSIX_FADV_WILLNEED)
            except OSError:
                pass  # an advice the filesystem refuses changes nothing that matters
            finally:
                os.close(fd)

    thread = threading.Thread(target=run, name="tierlab-readahead", daemon=True)
    thread.start()
    return thread


def evict(path: Path) -> int:
    """The opposite, for benchmarks and tests that start from a cold page cache: the file's
    dirty pages written, then all of it dropped from the page cache; returns its size."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        return os.fstat(fd).st_size
    finally:
        os.close(fd)
