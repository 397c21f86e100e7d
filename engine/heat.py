"""Heat profiles: how often each expert of each layer was routed.

A run writes one; a later run reads it to decide which experts the GPU tier
holds from the start: a heat-planned warmstart serves far more of the routed
experts from the tier than index order does (docs/routing.md, "Measured: the
GPU tier").

File format (the heat-profile format, docs/tiers.md; little-endian uint32):
``[0x51544831, n_layers, n_experts]`` then ``n_layers * n_experts`` counts,
layer-major (all experts of layer 0, then layer 1, ...).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np
from numba import njit

from tierlab.engine.atomic import write_atomic
from tierlab.engine.bounded_read import open_regular
from tierlab.engine.errors import FormatError

MAGIC = 0x51544831  # "1HTQ" as little-endian bytes
HEADER_WORDS = 3
UINT32_MAX = 2**32 - 1


class HeatProfile:
    """Routing counts per (layer, expert), int64 [n_layers, n_experts]."""

    def __init__(self, n_layers: int, n_experts: int, counts: np.ndarray | None = None) -> None:
        if n_layers <= 0 or n_experts <= 0:
            raise ValueError(f"heat profile needs positive dims, got {n_layers}x{n_experts}")
        if counts is None:
            counts = np.zeros((n_layers, n_experts), dtype=np.int64)
        counts = np.asarray(counts, dtype=np.int64)
        if counts.shape != (n_layers, n_experts):
            raise ValueError(f"counts shape {counts.shape} is not {(n_layers, n_experts)}")
        self.counts = counts

    @property
    def n_layers(self) -> int:
        return self.counts.shape[0]

    @property
    def n_experts(self) -> int:
        return self.counts.shape[1]

    def add(self, layer: int, experts: Iterable[int]) -> None:
        """Count one routing of `experts` in `layer`; -1 (an unfilled slot) is skipped."""
        ids = np.asarray(list(experts) if not isinstance(experts, np.ndarray) else experts, dtype=np.int64)
        ids = ids[ids >= 0]
        np.add.at(self.counts[layer], ids, 1)

    def merge(self, other: "HeatProfile") -> "HeatProfile":
        _check_same_dims(self, other)
        return HeatProfile(self.n_layers, self.n_experts, self.counts + other.counts)

    # --- file I/O -------------------------------------------------------

    def to_bytes(self) -> bytes:
        """Counts saturate at 2**32-1, the format's limit."""
        header = np.array([MAGIC, self.n_layers, self.n_experts], dtype="<u4")
        body = np.clip(self.counts, 0, UINT32_MAX).astype("<u4")
        return header.tobytes() + body.tobytes()

    def write(self, path: str | os.PathLike) -> None:
        """Write atomically, keeping the file's mode: a reader sees the old file or the new one, never half of one."""
        write_atomic(path, self.to_bytes())

    @classmethod
    def from_bytes(
        cls, data: bytes, source: str | os.PathLike = "<bytes>", n_layers: int | None = None, n_experts: int | None = None
    ) -> "HeatProfile":
        """Parse and validate; every problem is one FormatError line naming `source`."""
        if len(data) < 4 * HEADER_WORDS:
            raise FormatError(f"not a heat profile: {len(data)} bytes is shorter than the 12-byte header", source)
        magic, layers, experts = (int(v) for v in np.frombuffer(data, dtype="<u4", count=HEADER_WORDS))
        if magic != MAGIC:
            raise FormatError(f"not a heat profile: magic 0x{magic:08x}, expected 0x{MAGIC:08x}", source)
        if layers == 0 or experts == 0:
            raise FormatError(f"heat profile has empty dims {layers}x{experts}", source)
        expected = 4 * (HEADER_WORDS + layers * experts)
        if len(data) != expected:
            what = "truncated" if len(data) < expected else "has trailing bytes"
            raise FormatError(
                f"heat profile {what}: {layers}x{experts} needs {expected} bytes, file has {len(data)}", source
            )
        _check_model_dims(layers, experts, n_layers, n_experts, source)
        counts = np.frombuffer(data, dtype="<u4", offset=4 * HEADER_WORDS).astype(np.int64).reshape(layers, experts)
        return cls(layers, experts, counts)

    @classmethod
    def read(cls, path: str | os.PathLike, n_layers: int | None = None, n_experts: int | None = None) -> "HeatProfile":
        """Read a heat file, checking it against the model's dims when given.

        The header's dims give the file's exact size: a file of any other size
        is refused before its counts are read."""
        fd, size = open_regular(path, "heat profile", FormatError)
        try:
            head = os.pread(fd, 4 * HEADER_WORDS, 0)
            data = head  # anything but a well-formed header: from_bytes names the problem from it
            if len(head) == 4 * HEADER_WORDS:
                magic, layers, experts = (int(v) for v in np.frombuffer(head, dtype="<u4"))
                if magic == MAGIC and layers and experts:
                    expected = 4 * (HEADER_WORDS + layers * experts)
                    if size != expected:
                        what = "truncated" if size < expected else "has trailing bytes"
                        raise FormatError(f"heat profile {what}: {layers}x{experts} needs {expected} bytes, "
                                          f"file has {size}", path)
                    _check_model_dims(layers, experts, n_layers, n_experts, path)
                    data = os.pread(fd, expected, 0)
        except OSError as exc:
            raise FormatError(f"cannot read heat profile: {exc.strerror}", path) from None
        finally:
            os.close(fd)
        return cls.from_bytes(data, path, n_layers, n_experts)

    # --- planning -------------------------------------------------------

    def plan(self, budget_experts: int) -> list[tuple[int, int]]:
        """The `budget_experts` hottest (layer, expert) pairs, hottest first across all layers.

        Ties go to the lower layer, then the lower expert id, so a plan is
        reproducible from the same bytes.
        """
        flat = self.counts.reshape(-1)
        # lexsort: last key is primary; flat index = layer-major, so it breaks ties by layer then expert.
        order = np.lexsort((np.arange(flat.size), -flat))
        order = order[: max(0, min(int(budget_experts), flat.size))]
        return [(int(i) // self.n_experts, int(i) % self.n_experts) for i in order]

    # --- summaries ------------------------------------------------------

    def summary(self, layer: int, top: int = 8) -> "LayerSummary":
        return summarize_counts(layer, self.counts[layer], top)

    def summaries(self, top: int = 8) -> list["LayerSummary"]:
        return [self.summary(layer, top) for layer in range(self.n_layers)]


def _check_model_dims(layers: int, experts: int, n_layers: int | None, n_experts: int | None, source) -> None:
    if (n_layers is not None and layers != n_layers) or (n_experts is not None and experts != n_experts):
        raise FormatError(
            f"heat profile is {layers} layers x {experts} experts, "
            f"the model has {n_layers if n_layers is not None else layers} x "
            f"{n_experts if n_experts is not None else experts}",
            source,
        )


def index_order(n_layers: int, n_experts: int, budget_experts: int) -> list[tuple[int, int]]:
    """The no-profile warmstart: layer 0's experts 0..E-1, then layer 1's, ... up to the budget."""
    total = max(0, min(int(budget_experts), n_layers * n_experts))
    return [(i // n_experts, i % n_experts) for i in range(total)]


@dataclass(frozen=True)
class LayerSummary:
    """How concentrated one layer's routing is."""

    layer: int
    routings: int
    top: list[tuple[int, int]]  # (expert, count), most routed first
    entropy_nats: float
    entropy_norm: float  # entropy / ln(n_experts): 1 = uniform, 0 = one expert
    cover50: int  # fewest experts whose counts reach 50% of the routings
    cover90: int


def summarize_counts(layer: int, counts: np.ndarray, top: int = 8) -> LayerSummary:
    counts = np.asarray(counts, dtype=np.int64)
    total = int(counts.sum())
    order = np.lexsort((np.arange(counts.size), -counts))
    top_pairs = [(int(e), int(counts[e])) for e in order[:top] if counts[e] > 0]
    if total == 0:
        return LayerSummary(layer, 0, [], 0.0, 0.0, 0, 0)
    p = counts[order] / total
    nz = p[p > 0]
    entropy = float(-(nz * np.log(nz)).sum())
    norm = entropy / math.log(counts.size) if counts.size > 1 else 0.0
    cum = np.cumsum(counts[order])
    return LayerSummary(
        layer,
        total,
        top_pairs,
        entropy,
        norm,
        _cover(cum, 0.5 * total),
        _cover(cum, 0.9 * total),
    )


def _cover(cumulative: np.ndarray, target: float) -> int:
    return int(np.searchsorted(cumulative, target - 1e-9 * max(1.0, target), side="left")) + 1


@dataclass(frozen=True)
class LayerDiff:
    """How differently two profiles route one layer."""

    layer: int
    top_overlap: float  # |top_a ∩ top_b| / top, on the top-N sets
    tvd: float  # total variation distance of the normalised counts, 0..1
    js: float  # Jensen-Shannon divergence in nats, 0..ln 2


def diff(a: HeatProfile, b: HeatProfile, top: int = 8) -> list[LayerDiff]:
    """Per-layer comparison; a layer with no routings on either side reads as NaN."""
    _check_same_dims(a, b)
    top = max(1, min(top, a.n_experts))
    out = []
    for layer in range(a.n_layers):
        ca, cb = a.counts[layer], b.counts[layer]
        ta, tb = int(ca.sum()), int(cb.sum())
        if ta == 0 or tb == 0:
            out.append(LayerDiff(layer, math.nan, math.nan, math.nan))
            continue
        set_a = set(np.lexsort((np.arange(ca.size), -ca))[:top].tolist())
        set_b = set(np.lexsort((np.arange(cb.size), -cb))[:top].tolist())
        pa, pb = ca / ta, cb / tb
        out.append(LayerDiff(layer, len(set_a & set_b) / top, 0.5 * float(np.abs(pa - pb).sum()), _js(pa, pb)))
    return out


def _js(p: np.ndarray, q: np.ndarray) -> float:
    m = 0.5 * (p + q)

    def kl(x: np.ndarray) -> float:
        nz = x > 0
        return float((x[nz] * np.log(x[nz] / m[nz])).sum())

    return max(0.0, 0.5 * kl(p) + 0.5 * kl(q))


def _check_same_dims(a: HeatProfile, b: HeatProfile) -> None:
    if a.counts.shape != b.counts.shape:
        raise FormatError(
            f"heat profiles differ in shape: {a.n_layers}x{a.n_experts} vs {b.n_layers}x{b.n_experts}"
        )


def from_routes(n_layers: int, n_experts: int, routes: Sequence[Sequence[Iterable[int]]]) -> HeatProfile:
    """A profile from a trace: routes[token][layer] = the experts routed."""
    heat = HeatProfile(n_layers, n_experts)
    for token in routes:
        for layer, experts in enumerate(token):
            heat.add(layer, experts)
    return heat


@njit(nogil=True, cache=True)
def add_routed(counts, layers, chosen):
    """counts[layers[i], e] += 1 for every filled slot's expert e of each routing i (chosen[i, s]
    >= 0, ids distinct within a row): routings into a [n_layers, n_experts] count in one call,
    so a count never holds part of them."""
    for i in range(chosen.shape[0]):
        layer = layers[i]
        for s in range(chosen.shape[1]):
            e = chosen[i, s]
            if e >= 0:
                counts[layer, e] += 1
