"""What opening an engine needs, in one value: the model folder, the RAM cache, the memory
budget, the tier, the knobs.

Every command, the app and the A/B runner open engines through
`EngineOptions.open`, so each takes the same settings the same way. Without
an explicit `cache`, the RAM cache is what the memory budget leaves
(engine/budget.py: `ram_gb`, else TIER_RAM_GB, else auto); the shipped models
fit whole, so their cache is every expert.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import tierlab
from tierlab.engine.budget import DEFAULT_CONTEXT, BudgetPlan, plan_for, ram_gb_setting
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
    ram_gb: str | float | None = None  # the memory budget in GiB over TIER_RAM_GB; None: the variable, else auto
    context: int = DEFAULT_CONTEXT  # tokens the budget holds KV state for

    def budget_plan(self, config=None) -> BudgetPlan | None:
        """The memory budget's split (engine/budget.py), None when `cache` sets the slots (or auto
        finds no memory figure); SettingError for a malformed budget, ModelError when the dense
        weights do not fit."""
        ram_gb, origin = ram_gb_setting(None if self.ram_gb is None else str(self.ram_gb))
        if self.cache is not None:
            return None
        from tierlab.engine.config import load_config

        cfg = config if config is not None else load_config(self.model)
        return plan_for(self.model, cfg, ram_gb, origin, self.context)

    def open(self, with_tokenizer: bool = True, progress=None):
        """Load the engine; ModelError/KnobError reach the caller as one line. `progress` hears
        the kernel warm-up's steps (engine/warmup.py: done, total, label, kernels compiled)."""
        from tierlab.engine.model import load_engine

        knobs = Knobs.from_env(**self.knobs) if self.knobs_from_env else Knobs.from_env(self.knobs)
        cache = self.cache
        if cache is None and Path(self.model).is_dir():
            plan = self.budget_plan()
            cache = plan.slots if plan is not None else None
        return load_engine(self.model, cache_slots=cache, knobs=knobs, with_tokenizer=with_tokenizer,
                           tier=self.tier, warmup=self.warmup, progress=progress)
