"""What opening an engine needs, in one value: the model folder, the RAM cache, the tier, the knobs.

Every command, the app and the A/B runner open engines through
`EngineOptions.open`, so each takes the same settings the same way.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import tierlab
from tierlab.engine.knobs import Knobs
from tierlab.engine.tiering import TierOptions


def default_model() -> Path:
    """The shipped model: assets/tiny-moe, else another shipped model folder."""
    main = tierlab.ASSETS_DIR / "tiny-moe"
    if (main / "config.json").exists():
        return main
    others = sorted(p.parent for p in tierlab.ASSETS_DIR.glob("*/config.json"))
    return others[0] if others else main


def first_run_slots(n_experts: int, top_k: int) -> int:
    """The app's RAM cache when no --cache is given: 3/8 of the experts, at least 2·top_k,
    and always at least one expert short of all of them (12 of 32 for the shipped model), so
    that misses happen and the routing lever has something to do from the first reply."""
    wanted = max(2 * top_k, -(-3 * n_experts // 8))
    return max(1, min(n_experts - 1, wanted))


@dataclass
class EngineOptions:
    model: Path = field(default_factory=default_model)
    cache: int | None = None  # RAM slots per layer; None = every expert
    tier: TierOptions = field(default_factory=TierOptions.from_env)
    knobs: dict[str, str | None] = field(default_factory=dict)  # knob name -> value over the environment
    knobs_from_env: bool = True  # False: defaults plus `knobs`, the environment ignored (A/B rows)
    warmup: bool = True  # compile every reachable kernel while loading (engine/warmup.py)

    def open(self, with_tokenizer: bool = True, progress=None):
        """Load the engine; ModelError/KnobError reach the caller as one line. `progress` hears
        the kernel warm-up's steps (engine/warmup.py: done, total, label, kernels compiled)."""
        from tierlab.engine.model import load_engine

        knobs = Knobs.from_env(**self.knobs) if self.knobs_from_env else Knobs.from_env(self.knobs)
        return load_engine(self.model, cache_slots=self.cache, knobs=knobs, with_tokenizer=with_tokenizer,
                           tier=self.tier, warmup=self.warmup, progress=progress)
