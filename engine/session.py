"""Recording a run of the engine into a session log (`--log FILE`).

Subscribes a `SessionLogWriter` to the engine's token events and to knob
changes, so every token and every change lands in the log as it happens
(flushed per record), and writes the meters of the tokens it recorded (its
own `MeterFold`, rates in percent as every JSON output writes them) as a
summary when closed.
"""

from __future__ import annotations

from pathlib import Path

from tierlab.engine.knobs import KnobChange
from tierlab.engine.meters import MeterFold, meters_json
from tierlab.engine.sessionlog import SessionLogWriter
from tierlab.engine.surface import EngineSurface


def model_record(engine: EngineSurface) -> dict:
    cfg = engine.config
    return {"path": str(engine.model_dir), "arch": cfg.arch, "n_layers": cfg.n_layers,
            "n_experts": cfg.n_experts, "top_k": cfg.top_k, "hidden": cfg.hidden_size,
            "expert_kind": engine.store_stats().expert_kind}


class EngineLog:
    def __init__(self, engine: EngineSurface, path: str | Path) -> None:
        self.engine = engine
        self.tokens = 0
        self.fold = MeterFold()
        self.meters: dict | None = None
        stats = engine.store_stats()
        self.writer = SessionLogWriter(
            path, model=model_record(engine), knobs=engine.knobs.snapshot(),
            cache={"ram_slots": stats.slots, "gpu_tier": stats.tier_on, "tier_residents": stats.tier_residents},
        )
        engine.subscribe(self._on_token)
        engine.knobs.subscribe(self._on_knob)

    def _on_token(self, event) -> None:
        self.writer.write_token(event)
        self.fold.add(event)
        self.tokens += 1

    def _on_knob(self, change: KnobChange) -> None:
        self.writer.write_knob_change(change, self.tokens)

    def detach(self) -> None:
        """Stop recording; the meters of the recorded tokens go into the summary."""
        if self.meters is None:
            self.engine.unsubscribe(self._on_token)
            self.engine.knobs.unsubscribe(self._on_knob)
            meters = meters_json(self.fold.summary())
            self.meters = {k: v for k, v in meters.items() if isinstance(v, (int, float))}

    def close(self, extra: dict | None = None) -> None:
        """Write the summary (meters plus `extra`, e.g. ids_match and tf_nll) and close."""
        self.detach()
        summary = {"meters": self.meters, "tokens": self.tokens}
        summary.update(extra or {})
        self.writer.write_summary(summary)
        self.writer.close()
