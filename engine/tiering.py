"""Attaching the GPU tier to an engine: open it, warm it, keep the heat profile.

The tier itself (`tierlab.engine.tiers.opencl_tier`) knows devices and
kernels; this module knows the engine: which experts to upload first (heat
order from HEAT_FILE, else index order), how to fall back to the CPU when
the device fails, and writing the run's heat profile on exit.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tierlab.engine.errors import FormatError, TierlabError


@dataclass
class TierOptions:
    enabled: bool = False  # TIER=1 / --tier
    budget: str = "auto"  # TIER_GB: GB or "auto"
    device: str | None = None  # TIER_DEVICE: substring of "platform / device"
    warmstart: bool = True  # TIER_NO_WARMSTART=1 turns it off
    heat_file: str | None = None  # HEAT_FILE: plan from it if it exists, write it on exit

    @classmethod
    def from_env(cls, env=None, **overrides) -> "TierOptions":
        env = os.environ if env is None else env
        opts = cls(
            enabled=env.get("TIER", "0").strip().lower() in ("1", "true", "on", "yes"),
            budget=env.get("TIER_GB", "auto").strip() or "auto",
            device=env.get("TIER_DEVICE") or None,
            warmstart=env.get("TIER_NO_WARMSTART", "0").strip() not in ("1", "true", "on", "yes"),
            heat_file=env.get("HEAT_FILE") or None,
        )
        for key, value in overrides.items():
            if value is not None:
                setattr(opts, key, value)
        return opts


def load_heat(engine, path: str | Path):
    """The profile at `path` checked against the model, or None if the file does not exist yet."""
    from tierlab.engine.heat import HeatProfile

    if not Path(path).exists():
        return None
    cfg = engine.config
    return HeatProfile.read(path, cfg.n_layers, cfg.n_experts)


def attach_tier(engine, opts: TierOptions) -> None:
    """Open the tier and warm it; on any device trouble the engine simply runs without it."""
    from tierlab.engine.tiers.opencl_tier import OpenCLTier

    engine.heat_file = opts.heat_file
    engine.base_heat = load_heat(engine, opts.heat_file) if opts.heat_file else None
    if not opts.enabled:
        return
    source = engine.cache.source
    try:
        tier = OpenCLTier.open(source.kind, source.hidden, source.inter, source.blob_nbytes,
                               budget=opts.budget, device=opts.device, notice=engine.notice)
    except ValueError as exc:  # a malformed TIER_GB
        raise TierlabError(str(exc)) from None
    if tier is None:
        return
    engine.tier = tier
    engine.cache.gpu_resident = tier.is_resident
    engine.tier_report = {"device": tier.device_label, "capacity": tier.capacity}
    if opts.warmstart:
        warm(engine, tier)


def warm(engine, tier) -> None:
    """Upload experts in heat order (HEAT_FILE, if it exists yet) or index order until full."""
    from tierlab.engine.tiers.warmstart import warmstart

    cfg = engine.config
    heat_file = engine.heat_file if engine.base_heat is not None else None
    report = warmstart(tier, engine.cache.source.read, cfg.n_layers, cfg.n_experts, heat_file=heat_file,
                       moe_layers=cfg.moe_layers)
    engine.tier_report.update(warmstart=report.order, uploaded=report.uploaded, bytes=int(tier.stats.bytes),
                              seconds=report.seconds)
    engine.notice(f"GPU tier on {tier.device_label}: {report.uploaded} experts resident ({report.order} order, "
                  f"{tier.stats.bytes / 2**20:.1f} MiB)")


def tier_enqueue(engine, layer: int, experts: list[int], x: np.ndarray):
    from tierlab.engine.tiers.opencl_tier import TierFailure

    if engine.tier is None:
        return None
    try:
        return engine.tier.enqueue(layer, experts, np.ascontiguousarray(x, dtype=np.float32))
    except TierFailure:
        detach_tier(engine)
        return None


def tier_collect(engine, handle):
    from tierlab.engine.tiers.opencl_tier import TierFailure

    if engine.tier is None:
        return None
    try:
        return engine.tier.collect(handle)
    except TierFailure:
        detach_tier(engine)
        return None


def detach_tier(engine) -> None:
    """The device failed: carry on with the CPU (the tier already said why)."""
    if engine.tier is not None:
        engine.tier = None
        engine.cache.gpu_resident = lambda layer, expert: False


def write_heat(engine) -> str | None:
    """Write base profile + this run's counts to HEAT_FILE atomically; returns the path written."""
    from tierlab.engine.heat import HeatProfile

    path = getattr(engine, "heat_file", None)
    if not path:
        return None
    if Path(path).exists() and not Path(path).stat().st_mode & 0o222:  # mode bits: root ignores access()
        engine.notice(f"{path}: read-only heat profile kept as it is")
        return None
    cfg = engine.config
    counts = engine.heat_total.copy()
    if engine.base_heat is not None:
        counts += engine.base_heat.counts
    try:
        HeatProfile(cfg.n_layers, cfg.n_experts, counts).write(path)
    except (OSError, FormatError) as exc:
        engine.notice(f"{path}: heat profile not written ({getattr(exc, 'strerror', None) or exc})")
        return None
    return str(path)
