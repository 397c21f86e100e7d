"""The GPU expert tier (residency level 2) on PyOpenCL.

Expert blobs are uploaded as they are (fp32, bf16, int8 or int4; see
tierlab.engine.blob_layout) into one or more big pool buffers, one fixed-size slot each, and
the whole SwiGLU expert runs on the device while the engine's CPU threads
compute the experts that are not resident.

How the engine uses it::

    tier = OpenCLTier.open(kind, hidden, inter, blob_nbytes, budget=TIER_GB, device=TIER_DEVICE)
    if tier: tier.upload(layer, expert, blob)        # warmstart, in heat order
    handle = tier.enqueue(layer, resident_experts, x) # starts device work, returns at once
    ... CPU computes the other experts ...
    y = tier.collect(handle)                          # float32[len(experts), H], unweighted

Failure contract: ``open`` returns None after one notice line when there is
no usable device or the kernels do not build. Later, any ``cl.Error`` in
``enqueue``/``collect`` disables the whole tier (one notice) and raises
``TierFailure``; from then on nothing is resident, ``enqueue`` raises
``TierFailure`` at once and ``upload`` returns False, so the engine catches
``TierFailure`` once, computes those experts on the CPU and carries on
without the tier. ``upload`` never raises for device trouble: it returns
False (device out of memory or budget full: one notice, the tier keeps what
it holds).
"""

from __future__ import annotations

import heapq
import os
import threading
from dataclasses import dataclass
from typing import Callable

import numpy as np

from tierlab.engine.errors import TierlabError
from tierlab.engine.blob_layout import BlobLayout
from tierlab.engine.tiers.opencl_device import GiB, NoDevice, parse_budget, pick_device, resolve_budget
from tierlab.engine.tiers.opencl_kernels import SOURCE, build_options

SLOT_ALIGN = 256  # every blob starts on a 256-byte boundary (float loads, coalescing)
SCRATCH_RING = 4  # enqueued-but-not-collected handles that can coexist
GPU_WORK_GROUP = 128

Notice = Callable[[str], None]


class TierFailure(TierlabError):
    """The device failed mid-run; the tier is now disabled and the engine should use the CPU."""


@dataclass
class TierStats:
    uploads: int = 0  # successful blob uploads
    bytes: int = 0  # bytes uploaded in total
    residents: int = 0  # experts resident now
    enqueues: int = 0  # enqueue calls (tokens x layers served)
    experts_run: int = 0  # experts computed on the device


@dataclass
class _Scratch:
    """Per-handle device buffers; reused round-robin once their last work has finished."""

    capacity: int  # experts per call
    x: object
    offsets: object
    h: object
    out: object
    busy: object = None  # the last event that reads into host memory from these buffers


@dataclass
class TierHandle:
    experts: list[int]
    out: np.ndarray  # float32[n, H] in device order
    perm: np.ndarray | None  # device row i belongs to experts[perm[i]]; None = same order
    done: object  # event of the read-back
    keep: tuple  # host arrays that non-blocking copies still read


class OpenCLTier:
    """Experts resident on an OpenCL device, computed there on request."""

    def __init__(self, cl, choice, context, queue, program, layout: BlobLayout, budget_bytes: int,
                 work_group: int, notice: Notice) -> None:
        self._cl = cl
        self.device_label = choice.label
        self.is_cpu_device = choice.is_cpu
        self._ctx = context
        self._queue = queue
        self._gate_up = cl.Kernel(program, "gate_up")
        self._down = cl.Kernel(program, "down")
        self.layout = layout
        self.kind = layout.kind
        self.hidden = layout.hidden
        self.inter = layout.inter
        self.blob_nbytes = layout.nbytes
        self.work_group = work_group
        self.budget_bytes = budget_bytes
        self._notice = notice
        self._noticed: set[str] = set()
        self.slot_stride = -(-layout.nbytes // SLOT_ALIGN) * SLOT_ALIGN
        self.capacity = budget_bytes // self.slot_stride
        max_alloc = int(choice.device.max_mem_alloc_size)
        self.slots_per_pool = max(1, min(self.capacity, max_alloc // self.slot_stride))
        self._pools: list[object] = []
        self._free: list[int] = list(range(self.capacity))  # a heap: lowest slot first keeps pools dense
        self._slot_of: dict[tuple[int, int], int] = {}
        self._masks: dict[int, np.ndarray] = {}  # layer -> bool per expert id: resident_mask is called per token
        self._lock = threading.RLock()  # uploads may come from a loader thread while the engine enqueues
        self._scratch: list[_Scratch | None] = [None] * SCRATCH_RING
        self._next_scratch = 0
        self.failed: str | None = None
        self.stats = TierStats()

    # --- construction -----------------------------------------------------

    @classmethod
    def open(
        cls,
        kind: str,
        hidden: int,
        inter: int,
        blob_nbytes: int,
        budget: str | float | None = "auto",
        device: str | None = None,
        notice: Notice = print,
        *,
        row_mode: str = "auto",
        kernel_source: str | None = None,
    ) -> "OpenCLTier | None":
        """A ready tier, or None after one notice line (no driver, no matching device, no build).

        `device` is a substring of "platform / device" (TIER_DEVICE is read when it is None);
        `budget` is "auto" or GiB. `row_mode` ("auto", "row", "group") and `kernel_source`
        exist for tests and benchmarks. A bad budget or a blob size that does not match the
        layout raises ValueError: those are caller bugs, not device trouble.
        """
        layout = BlobLayout(kind, hidden, inter)
        if blob_nbytes != layout.nbytes:
            raise ValueError(f"{kind} expert {hidden}x{inter} is {layout.nbytes} bytes, engine says {blob_nbytes}")
        parse_budget(budget)  # raise early on a bad value
        if device is None:
            device = os.environ.get("TIER_DEVICE") or None
        try:
            import pyopencl as cl
        except ImportError as exc:
            notice(f"GPU tier off: pyopencl is not importable ({exc})")
            return None
        try:
            choice = pick_device(cl, device)
        except NoDevice as exc:
            notice(f"GPU tier off: {exc}")
            return None
        dev = choice.device
        budget_bytes, clamp_note = resolve_budget(budget, int(dev.global_mem_size), choice.is_cpu)
        if clamp_note:
            notice(f"GPU tier: {clamp_note}")
        if budget_bytes < -(-layout.nbytes // SLOT_ALIGN) * SLOT_ALIGN:
            notice(f"GPU tier off: a budget of {budget_bytes / GiB:.3f} GiB holds no {kind} expert "
                   f"({layout.nbytes / 2**20:.2f} MiB)")
            return None
        if row_mode == "auto":
            row_mode = "row" if choice.is_cpu else "group"
        if row_mode not in ("row", "group"):
            raise ValueError(f"row_mode must be auto, row or group, not {row_mode!r}")
        work_group = 0
        if row_mode == "group":
            work_group = 1 << (min(GPU_WORK_GROUP, int(dev.max_work_group_size)).bit_length() - 1)
        try:
            context = cl.Context([dev])
            queue = cl.CommandQueue(context, dev)
            program = cl.Program(context, kernel_source if kernel_source is not None else SOURCE)
            program.build(options=build_options(layout, work_group), devices=[dev])
            tier = cls(cl, choice, context, queue, program, layout, budget_bytes, work_group, notice)
        except cl.Error as exc:
            notice(f"GPU tier off: {kind} kernels failed to build on {choice.label}: {_first_line(exc)}")
            return None
        return tier

    # --- residency --------------------------------------------------------

    def is_resident(self, layer: int, expert: int) -> bool:
        return (layer, expert) in self._slot_of

    def resident_mask(self, layer: int, n_experts: int) -> np.ndarray:
        mask = np.zeros(n_experts, dtype=bool)
        held = self._masks.get(layer)
        if held is not None:
            n = min(n_experts, held.size)
            mask[:n] = held[:n]
        return mask

    def _set_mask(self, layer: int, expert: int, value: bool) -> None:
        held = self._masks.get(layer)
        if held is None or held.size <= expert:
            grown = np.zeros(max(expert + 1, 2 * (0 if held is None else held.size)), dtype=bool)
            if held is not None:
                grown[: held.size] = held
            self._masks[layer] = held = grown
        held[expert] = value

    def residents(self) -> list[tuple[int, int]]:
        return sorted(self._slot_of)

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def upload(self, layer: int, expert: int, blob: np.ndarray) -> bool:
        """Copy one blob into a slot. False (one notice) when full, out of device memory or failed."""
        with self._lock:
            return self._upload(layer, expert, blob)

    def _upload(self, layer: int, expert: int, blob: np.ndarray) -> bool:
        if self.failed:
            return False
        data = np.ascontiguousarray(blob).view(np.uint8).reshape(-1)
        if data.size != self.blob_nbytes:
            raise ValueError(f"blob for layer {layer} expert {expert} is {data.size} bytes, expected {self.blob_nbytes}")
        key = (layer, expert)
        slot = self._slot_of.get(key)
        fresh = slot is None
        if fresh:
            if not self._free:
                self._notice_once("full", f"GPU tier full: {self.capacity} experts "
                                  f"({self.budget_bytes / GiB:.2f} GiB budget); the rest stay on the CPU")
                return False
            slot = heapq.heappop(self._free)
        cl = self._cl
        try:
            pool, offset = self._pool_offset(slot)
            cl.enqueue_copy(self._queue, pool, data, dst_offset=offset, is_blocking=True)
        except cl.Error as exc:
            if fresh:
                heapq.heappush(self._free, slot)
            if _is_out_of_memory(cl, exc):
                self._shrink_to_allocated()
                self._notice_once("oom", f"GPU tier: device out of memory after {len(self._slot_of)} experts; "
                                  f"capacity now {self.capacity}")
                self._noticed.add("full")  # that notice already says the tier is full
            else:
                self._disable(f"upload failed ({_first_line(exc)})")
            return False
        self._slot_of[key] = slot
        self._set_mask(layer, expert, True)
        self.stats.uploads += 1
        self.stats.bytes += data.size
        self.stats.residents = len(self._slot_of)
        return True

    def evict(self, layer: int, expert: int) -> bool:
        """Free the expert's slot for another upload; False when it was not resident."""
        with self._lock:
            slot = self._slot_of.pop((layer, expert), None)
            if slot is None:
                return False
            heapq.heappush(self._free, slot)
            self._set_mask(layer, expert, False)
            self.stats.residents = len(self._slot_of)
            return True

    # --- compute ----------------------------------------------------------

    def enqueue(self, layer: int, experts: list[int], x: np.ndarray) -> TierHandle:
        """Start the fused expert for these resident experts on x (float32[H]); returns at once.

        Raises TierFailure when the tier is (or just became) disabled, ValueError for an
        expert that is not resident. At most SCRATCH_RING handles may be uncollected.
        """
        with self._lock:
            return self._enqueue(layer, experts, x)

    def _enqueue(self, layer: int, experts: list[int], x: np.ndarray) -> TierHandle:
        if self.failed:
            raise TierFailure(f"GPU tier is off: {self.failed}")
        experts = [int(e) for e in experts]
        try:
            slots = [self._slot_of[(layer, e)] for e in experts]
        except KeyError as exc:
            raise ValueError(f"layer {layer} expert {exc.args[0][1]} is not resident in the GPU tier") from None
        n = len(slots)
        x_host = np.array(x, dtype=np.float32, copy=True).reshape(-1)  # the caller may reuse x at once
        if x_host.size != self.hidden:
            raise ValueError(f"x has {x_host.size} values, hidden is {self.hidden}")
        out = np.empty((n, self.hidden), dtype=np.float32)
        if n == 0:
            return TierHandle(experts, out, None, None, ())
        pools = [s // self.slots_per_pool for s in slots]
        perm = None
        if any(p != pools[0] for p in pools):
            perm = np.argsort(np.asarray(pools), kind="stable")
            slots = [slots[i] for i in perm]
            pools = [pools[i] for i in perm]
        offsets = np.asarray([(s % self.slots_per_pool) * self.slot_stride for s in slots], dtype=np.uint64)
        cl = self._cl
        try:
            scratch = self._take_scratch(n)
            q = self._queue
            cl.enqueue_copy(q, scratch.x, x_host, is_blocking=False)
            cl.enqueue_copy(q, scratch.offsets, offsets, is_blocking=False)
            start = 0
            while start < n:
                stop = start
                while stop < n and pools[stop] == pools[start]:
                    stop += 1
                self._launch(self._pools[pools[start]], scratch, start, stop - start)
                start = stop
            done = cl.enqueue_copy(q, out, scratch.out, is_blocking=False)
            scratch.busy = done
        except cl.Error as exc:
            self._disable(f"enqueue failed ({_first_line(exc)})")
            raise TierFailure(f"GPU tier is off: {self.failed}") from None
        self.stats.enqueues += 1
        self.stats.experts_run += n
        return TierHandle(experts, out, perm, done, (x_host, offsets))

    def collect(self, handle: TierHandle) -> np.ndarray:
        """Wait for the handle's work; float32[len(experts), H], row i = experts[i]'s output, unweighted."""
        if handle.done is not None:
            try:
                handle.done.wait()
            except self._cl.Error as exc:
                self._disable(f"device work failed ({_first_line(exc)})")
                raise TierFailure(f"GPU tier is off: {self.failed}") from None
            handle.done = None
            handle.keep = ()
        if handle.perm is None:
            return handle.out
        result = np.empty_like(handle.out)
        result[handle.perm] = handle.out
        return result

    def run(self, layer: int, experts: list[int], x: np.ndarray) -> np.ndarray:
        """enqueue + collect, for callers that have nothing to overlap."""
        return self.collect(self.enqueue(layer, experts, x))

    def close(self) -> None:
        """Release device memory; the tier holds nothing afterwards."""
        with self._lock:
            self._close()

    def _close(self) -> None:
        try:
            self._queue.finish()
        except Exception:
            pass
        for buf in self._pools:
            _release(buf)
        for scratch in self._scratch:
            if scratch is not None:
                for buf in (scratch.x, scratch.offsets, scratch.h, scratch.out):
                    _release(buf)
        self._pools = []
        self._scratch = [None] * SCRATCH_RING
        self._slot_of.clear()
        self._masks.clear()
        self._free = []
        self.capacity = 0
        self.stats.residents = 0
        if not self.failed:
            self.failed = "closed"

    def __enter__(self) -> "OpenCLTier":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def describe(self) -> str:
        mode = f"work-group {self.work_group} per row" if self.work_group else "one work-item per row"
        return (f"{self.device_label}: {self.kind} {self.hidden}x{self.inter}, {self.capacity} experts in "
                f"{self.budget_bytes / GiB:.2f} GiB, {mode}")

    # --- internals --------------------------------------------------------

    def _launch(self, pool, scratch: _Scratch, first: int, count: int) -> None:
        first_arg = np.uint32(first)
        wg = self.work_group
        self._gate_up.set_args(pool, scratch.offsets, first_arg, scratch.x, scratch.h)
        self._down.set_args(pool, scratch.offsets, first_arg, scratch.h, scratch.out)
        if wg:
            self._cl.enqueue_nd_range_kernel(self._queue, self._gate_up, (count * self.inter * wg,), (wg,))
            self._cl.enqueue_nd_range_kernel(self._queue, self._down, (count * self.hidden * wg,), (wg,))
        else:
            self._cl.enqueue_nd_range_kernel(self._queue, self._gate_up, (count * self.inter,), None)
            self._cl.enqueue_nd_range_kernel(self._queue, self._down, (count * self.hidden,), None)

    def _pool_offset(self, slot: int) -> tuple[object, int]:
        index, within = divmod(slot, self.slots_per_pool)
        while len(self._pools) <= index:
            first_slot = len(self._pools) * self.slots_per_pool
            slots = min(self.slots_per_pool, self.capacity - first_slot)
            self._pools.append(self._cl.Buffer(self._ctx, self._cl.mem_flags.READ_ONLY, slots * self.slot_stride))
        return self._pools[index], within * self.slot_stride

    def _shrink_to_allocated(self) -> None:
        """After an allocation failure: keep only slots of pools that hold residents."""
        used_pools = {s // self.slots_per_pool for s in self._slot_of.values()}
        keep = max(used_pools) + 1 if used_pools else 0
        for buf in self._pools[keep:]:
            _release(buf)
        self._pools = self._pools[:keep]
        self.capacity = min(self.capacity, keep * self.slots_per_pool)
        self._free = [s for s in self._free if s < self.capacity]
        heapq.heapify(self._free)

    def _take_scratch(self, n: int) -> _Scratch:
        index = self._next_scratch
        self._next_scratch = (index + 1) % SCRATCH_RING
        scratch = self._scratch[index]
        if scratch is not None and scratch.busy is not None:
            scratch.busy.wait()
            scratch.busy = None
        if scratch is None or scratch.capacity < n:
            cl, ctx, mf = self._cl, self._ctx, self._cl.mem_flags
            cap = max(n, 16 if scratch is None else 2 * scratch.capacity)
            scratch = _Scratch(
                cap,
                cl.Buffer(ctx, mf.READ_ONLY, self.hidden * 4),
                cl.Buffer(ctx, mf.READ_ONLY, cap * 8),
                cl.Buffer(ctx, mf.READ_WRITE, cap * self.inter * 4),
                cl.Buffer(ctx, mf.WRITE_ONLY, cap * self.hidden * 4),
            )
            self._scratch[index] = scratch
        return scratch

    def _disable(self, reason: str) -> None:
        if self.failed:
            return
        self.failed = reason
        self._slot_of.clear()
        self._masks.clear()
        self._free = []
        self.stats.residents = 0
        self._notice_once("failed", f"GPU tier off on {self.device_label}: {reason}; experts run on the CPU")

    def _notice_once(self, key: str, message: str) -> None:
        if key not in self._noticed:
            self._noticed.add(key)
            self._notice(message)


def _is_out_of_memory(cl, exc: Exception) -> bool:
    if isinstance(exc, cl.MemoryError):
        return True
    try:
        code = exc.code  # type: ignore[attr-defined]
    except Exception:
        code = None
    if code is None and exc.args and hasattr(exc.args[0], "code"):
        code = exc.args[0].code
    return code in (cl.status_code.MEM_OBJECT_ALLOCATION_FAILURE, cl.status_code.OUT_OF_RESOURCES,
                    cl.status_code.OUT_OF_HOST_MEMORY, cl.status_code.INVALID_BUFFER_SIZE)


def _release(buf) -> None:
    try:
        buf.release()
    except Exception:
        pass


def _first_line(exc: Exception) -> str:
    text = str(exc).strip()
    for line in text.splitlines():
        if line.strip():
            return line.strip()[:300]
    return exc.__class__.__name__
