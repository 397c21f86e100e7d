"""prompt_heap: inside, a large freed array's pages stay for the next one; after, they go back."""

import numpy as np
import pytest

from tierlab.engine import prompt_heap

MIB = 1 << 20
SIZE = 48 * MIB  # above glibc's largest mmap threshold: outside a prompt always a fresh mapping


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


@pytest.mark.skipif(not prompt_heap.active(), reason="glibc only")
def test_pages_are_reused_inside_and_returned_after():
    base = _rss()
    with prompt_heap.prompt_heap():
        a = np.ones(SIZE // 4, dtype=np.float32)
        del a
        kept = _rss()
        assert kept > base + SIZE // 2  # freed, but the pages stay in the heap
        b = np.ones(SIZE // 4, dtype=np.float32)  # the next layer's array lands on them
        assert _rss() < kept + 8 * MIB
        del b
        with prompt_heap.prompt_heap():  # nested (another engine's pass): nothing changes yet
            pass
        assert _rss() > base + SIZE // 2
    assert _rss() < base + 16 * MIB  # trimmed when the last pass ends


@pytest.mark.skipif(not prompt_heap.active(), reason="glibc only")
def test_outside_a_prompt_a_large_array_is_unmapped_when_freed():
    base = _rss()
    a = np.ones(SIZE // 4, dtype=np.float32)
    assert _rss() > base + SIZE // 2
    del a
    assert _rss() < base + 16 * MIB
