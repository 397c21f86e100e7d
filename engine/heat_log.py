"""HEAT_FILE for one process: the profile read at start, this run's routing counts, the write on close.

The profile read at start plans the GPU tier's warmstart; on close the file
gets every routing of this process (never reset by the meters) added to what
the file holds at that moment, under a lock on ``HEAT_FILE.lock`` and
written atomically with the file's mode kept, so runs that share a
HEAT_FILE, one after another or at the same time, add up exactly. A frozen
log (A/B arms and replays: app/lab/arms.py) records and writes nothing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np

from tierlab.engine.atomic import locked
from tierlab.engine.errors import FormatError
from tierlab.engine.heat import HeatProfile, add_routed


class HeatLog:
    def __init__(self, path: str | None, n_layers: int, n_experts: int) -> None:
        """Reads the profile at `path` if it exists (FormatError names the file if it is bad)."""
        self.path = path
        self.n_layers = n_layers
        self.n_experts = n_experts
        self.base = HeatProfile.read(path, n_layers, n_experts) if path and Path(path).exists() else None
        self.counts = np.zeros((n_layers, n_experts), dtype=np.int64)  # routings of this process
        self.frozen = False  # set for A/B arms and replays: their routings are not written

    @property
    def plan_file(self) -> str | None:
        """The file to plan a warmstart from: HEAT_FILE if it existed at start."""
        return self.path if self.base is not None else None

    def record(self, layer: int, experts: np.ndarray) -> None:
        """Count one token's experts of a layer (distinct ids; -1, an unfilled slot, is skipped)."""
        self.record_many(np.full(1, layer, dtype=np.int64), np.asarray(experts).reshape(1, -1))

    def record_many(self, layers: np.ndarray, chosen: np.ndarray) -> None:
        """Count routings i: experts chosen[i] (int [N, K], -1 skipped) of layer layers[i]."""
        if self.frozen:
            return
        add_routed(self.counts, layers, chosen)

    def write(self, notice: Callable[[str], None]) -> str | None:
        """Add this run's counts to HEAT_FILE as it is now, atomically; returns the path written.

        The counts written are cleared, so a second write adds only what was
        routed since. A read-only file is kept as it is; a failed write is
        one notice, never an exception.
        """
        path = self.path
        if not path or self.frozen:
            return None
        if Path(path).exists() and not Path(path).stat().st_mode & 0o222:  # mode bits: root ignores access()
            notice(f"{path}: read-only heat profile kept as it is")
            return None
        try:
            with locked(path):
                current = HeatProfile.read(path, self.n_layers, self.n_experts) if Path(path).exists() else None
                counts = self.counts.copy()
                if current is not None:
                    counts += current.counts
                HeatProfile(self.n_layers, self.n_experts, counts).write(path)
        except (OSError, FormatError) as exc:
            notice(f"{path}: heat profile not written ({getattr(exc, 'strerror', None) or exc})")
            return None
        self.counts[:] = 0
        return str(path)
