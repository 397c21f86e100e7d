"""Recording a session log from the app (``r``).

The writer is the engine's own `SessionLogWriter`; this module only wires it
to the app's `EngineWatch`, so tokens and knob changes land in the log with
the token index they first applied to, and writes the meters at the end.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tierlab.app.engine_watch import EngineWatch
from tierlab.app.files import LOG_SUFFIX, stamped_path
from tierlab.engine.knobs import KnobChange
from tierlab.engine.sessionlog import SessionLogWriter


def model_record(engine) -> dict:
    config = engine.config
    return {
        "path": str(getattr(engine, "model_dir", "")),
        "arch": getattr(config, "model_type", ""),
        "n_layers": int(config.n_layers),
        "n_experts": int(config.n_experts),
        "top_k": int(config.top_k),
    }


@dataclass
class Recorder:
    """An open session log fed by the engine's tokens and the knob changes."""

    path: Path
    writer: SessionLogWriter
    watch: EngineWatch
    engine: object
    written: int = 0
    """Token records written so far: a change applies from token record number `written` on."""

    def _on_token(self, event) -> None:
        self.writer.write_token(event)
        self.written += 1

    def _on_knob(self, change: KnobChange, token: int) -> None:
        self.writer.write_knob_change(change, self.written)

    def note_setting(self, name: str, value: object, token: int | None = None) -> None:
        """A change that is not a routing knob (the RAM cache size), logged like one."""
        self.writer.write_knob_change(KnobChange(0, name, None, value), self.written)

    def stop(self) -> Path:
        """Stop listening, write the meters as the summary and close the file."""
        self.watch.remove_token_listener(self._on_token)
        self.watch.remove_knob_listener(self._on_knob)
        try:
            meters = {k: v for k, v in self.engine.meters().items() if isinstance(v, (int, float))}
            self.writer.write_summary({"meters": meters, "tokens": self.watch.tokens_seen})
        finally:
            self.writer.close()
        return self.path


def start_recording(engine, watch: EngineWatch, folder: Path) -> Recorder:
    """Open a new log in `folder` and start writing every token and knob change to it."""
    path = stamped_path(Path(folder), "session", LOG_SUFFIX)
    slots = getattr(getattr(engine, "cache", None), "slots", None)
    writer = SessionLogWriter(
        path,
        model=model_record(engine),
        knobs=engine.knobs.snapshot(),
        cache={"ram_slots": slots, "gpu_tier": getattr(engine, "tier", None) is not None},
    )
    recorder = Recorder(path, writer, watch, engine)
    watch.add_token_listener(recorder._on_token)
    watch.add_knob_listener(recorder._on_knob)
    return recorder
