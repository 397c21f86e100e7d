"""A prompt's big temporaries reused from the heap while it runs, given back after it.

Why: glibc serves every allocation of 32 MiB or more (and, by its adaptive
threshold, some smaller ones) with a fresh mmap, so each layer of a prompt
starts its large temporaries (at 512 tokens: the tokens gathered for the
experts, their outputs, the DeltaNet projections, 16-32 MiB each) on
untouched pages, and the parallel kernels that write them first take the
page faults on both threads at once, which serialise in the kernel: a
parallel gather into fresh 32 MiB took 29 ms against 1 ms into memory
already touched (docs/benchmarks.md, "A prompt's temporaries on touched
pages"). While a multi-token pass runs, `prompt_heap()` has glibc take
every allocation from the heap (M_MMAP_MAX 0) and keep what is freed
(M_TRIM_THRESHOLD high), so the next layer reuses the previous layer's
pages; afterwards the limits are put back and `malloc_trim(0)` returns the
free pages to the system, so memory between passes is as it would be.

Setting any of these turns glibc's adaptive threshold off for the process,
so the limits outside a prompt are fixed at where that adaptation ends
(mmap from 32 MiB, trim above 64 MiB). A no-op where the C library is not
glibc. Nested or concurrent passes (several engines) share one count.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import threading
from contextlib import contextmanager

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_MMAP_MAX = -1, -3, -4
#: outside a prompt: where glibc's adaptive thresholds end up (its maximum mmap threshold)
_MMAP_THRESHOLD = 32 << 20
_TRIM_THRESHOLD = 64 << 20
_MMAP_MAX_DEFAULT = 65536
#: during a prompt: never trim (the largest value mallopt takes)
_NEVER_TRIM = (1 << 31) - 1


def _glibc():
    try:
        if not os.confstr("CS_GNU_LIBC_VERSION"):
            return None
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
        return libc
    except (OSError, ValueError, AttributeError):
        return None


_LIBC = _glibc()
_lock = threading.Lock()
_open = 0


def _outside() -> None:
    _LIBC.mallopt(_M_MMAP_MAX, _MMAP_MAX_DEFAULT)
    _LIBC.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD)
    _LIBC.mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD)


def active() -> bool:
    """Whether glibc is here to be told (else `prompt_heap` does nothing)."""
    return _LIBC is not None


@contextmanager
def prompt_heap():
    """Within: large allocations from the heap, kept when freed; on leaving the last one, the
    limits restored and the free pages returned (malloc_trim)."""
    global _open
    if _LIBC is None:
        yield
        return
    with _lock:
        if _open == 0:
            _LIBC.mallopt(_M_MMAP_MAX, 0)
            _LIBC.mallopt(_M_TRIM_THRESHOLD, _NEVER_TRIM)
        _open += 1
    try:
        yield
    finally:
        with _lock:
            _open -= 1
            if _open == 0:
                _outside()
                _LIBC.malloc_trim(0)


if _LIBC is not None:
    _outside()
