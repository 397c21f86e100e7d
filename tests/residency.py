"""Which pages of a buffer or a file are in memory, from the kernel's own page tables (mincore)."""

from __future__ import annotations

import ctypes
import mmap
from pathlib import Path

import numpy as np

from tierlab.engine import readahead


def resident_fraction(arr: np.ndarray) -> float:
    """Share of `arr`'s pages in memory (`arr` starts on a page boundary)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    pages = (arr.nbytes + mmap.PAGESIZE - 1) // mmap.PAGESIZE
    vec = (ctypes.c_ubyte * pages)()
    assert arr.ctypes.data % mmap.PAGESIZE == 0
    assert libc.mincore(arr.ctypes.data, arr.nbytes, vec) == 0, ctypes.get_errno()
    return sum(v & 1 for v in vec) / pages


def file_resident_fraction(path: Path) -> float:
    """Share of the file's pages in the page cache; mapping the file reads none of them."""
    mapped = np.memmap(path, dtype=np.uint8, mode="r")
    try:
        return resident_fraction(mapped)
    finally:
        mapped._mmap.close()


def evict(path: Path) -> bool:
    """Drop the file from the page cache; False where the filesystem keeps it (tmpfs)."""
    readahead.evict(path)
    return file_resident_fraction(path) < 0.1
