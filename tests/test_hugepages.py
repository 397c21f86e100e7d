"""Weight buffers on huge pages behave as ordinary numpy arrays."""

from __future__ import annotations

import numpy as np

from residency import resident_fraction
from tierlab.engine import hugepages


def test_large_buffers_are_writable_contiguous_arrays_that_keep_their_mapping():
    a = hugepages.empty((3, hugepages.MIN_HUGE_BYTES // 4), np.float32)
    assert a.shape == (3, hugepages.MIN_HUGE_BYTES // 4) and a.dtype == np.float32
    assert a.flags["C_CONTIGUOUS"] and a.flags["WRITEABLE"]
    a[:] = 2.5
    row = a[1]
    del a  # the row view keeps the mapping alive
    assert float(row.sum()) == 2.5 * row.size


def test_small_buffers_and_row_concatenation():
    small = hugepages.empty((4, 4), np.uint16)
    assert small.shape == (4, 4) and small.dtype == np.uint16
    parts = [np.arange(6, dtype=np.int8).reshape(2, 3), np.full((1, 3), -1, np.int8)]
    np.testing.assert_array_equal(hugepages.concat_rows(parts), np.concatenate(parts))
    big = [np.ones((hugepages.MIN_HUGE_BYTES // 8, 2), np.float32), np.zeros((5, 2), np.float32)]
    np.testing.assert_array_equal(hugepages.concat_rows(big), np.concatenate(big))


def test_a_prefaulted_buffer_is_resident_before_anything_writes_to_it():
    """The RAM cache's slots are faulted in while loading, not under the first prompt."""
    nbytes = 8 * hugepages.MIN_HUGE_BYTES
    lazy = hugepages.empty((nbytes,), np.uint8)
    ready = hugepages.empty((nbytes,), np.uint8, prefault=True)
    assert resident_fraction(lazy) < 0.5
    assert resident_fraction(ready) == 1.0
    ready[:] = 7  # still an ordinary writable array
    assert int(ready[::4096].sum()) == 7 * (nbytes // 4096)


def test_without_the_populate_advice_the_pages_are_touched_instead(monkeypatch):
    """A kernel before 5.14 rejects MADV_POPULATE_WRITE: each page is written once instead."""
    monkeypatch.setattr(hugepages, "MADV_POPULATE_WRITE", 0x7FFF)  # an advice no kernel knows
    ready = hugepages.empty((8 * hugepages.MIN_HUGE_BYTES,), np.uint8, prefault=True)
    assert resident_fraction(ready) == 1.0


def test_the_expert_cache_prefaults_its_slots_only_when_they_fit(oracle_models, monkeypatch):
    """Slots are resident at open when the memory allows; a cache larger than the memory
    left stays lazy (it would fail at open what it may never need)."""
    from tierlab.engine import budget
    from tierlab.engine.checkpoint import Checkpoint
    from tierlab.engine.config import load_config
    from tierlab.engine.expert_source import RawExpertSource
    from tierlab.engine.expert_store import ExpertStore

    folder = oracle_models["qwen3_moe"][1]
    source = RawExpertSource(Checkpoint(folder, load_config(folder)))
    slots = max(2, -(-8 * hugepages.MIN_HUGE_BYTES // source.blob_nbytes))  # a buffer on huge pages
    store = ExpertStore(source, 1, slots, slots, [True], notice=print)
    assert resident_fraction(store._layers[0]["store"]) == 1.0
    monkeypatch.setattr(budget, "auto_budget", lambda: 0)
    lazy = ExpertStore(source, 1, slots, slots - 2, [True], notice=print)
    assert resident_fraction(lazy._layers[0]["store"]) < 0.5
    lazy.set_slots(slots - 1)  # a resize decides again: the slots it gives back count as free
    assert resident_fraction(lazy._layers[0]["store"]) < 0.5
    monkeypatch.setattr(budget, "auto_budget", lambda: 1 << 40)
    lazy.set_slots(slots)
    assert resident_fraction(lazy._layers[0]["store"]) == 1.0
