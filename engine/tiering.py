"""How the GPU tier is asked for: TIER, TIER_GB, TIER_DEVICE, TIER_NO_WARMSTART, HEAT_FILE.

The expert store (`tierlab.engine.expert_store`) opens and warms the tier
from these options; the engine's heat log reads and writes HEAT_FILE.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


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
