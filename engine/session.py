"""Recording a run of the engine into a session log (`--log FILE`).

Subscribes a `SessionLogWriter` to the engine's token events and to knob
changes, so every token and every change lands in the log as it happens
(flushed per record). Its meters are a `WindowedMeters` of the recorded
tokens: each knob setting (a knob change or a new RAM cache size starts the
next) ends with a segment record carrying that setting's own meters, and
the summary carries the meters of the last setting ("meters") and of every
recorded token ("recorded"), rates in percent as every JSON output writes
them — never totals since the engine opened.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from tierlab.engine.knobs import KnobChange, KnobValues
from tierlab.engine.meters import Segment, WindowedMeters, meters_json, read_store_counters
from tierlab.engine.sessionlog import SessionLogWriter
from tierlab.engine.surface import EngineSurface


GREEDY = {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "seed": 0}
"""The sampling a log records when a run does not say: greedy (top_k 0: no top-k cut)."""


def model_record(engine: EngineSurface) -> dict:
    cfg = engine.config
    return {"path": str(engine.model_dir), "arch": cfg.arch, "n_layers": cfg.n_layers,
            "n_experts": cfg.n_experts, "top_k": cfg.top_k, "hidden": cfg.hidden_size,
            "expert_kind": engine.store_stats().expert_kind}


def _logged(summary: dict) -> dict:
    """A fold summary as a log record holds it: numbers (rates in percent) and nulls."""
    return {k: v for k, v in meters_json(summary).items() if v is None or isinstance(v, (int, float))}


class EngineLog:
    def __init__(self, engine: EngineSurface, path: str | Path, append: bool = False,
                 sampling: dict | None = None) -> None:
        """Records into a new file at `path` (or after what it holds, with `append`); a write that
        fails stops the recording with one engine notice and the run goes on. `sampling`:
        temperature, top_p, top_k, seed of the run (greedy when not given)."""
        self.engine = engine
        self.tokens = 0
        self.meters: dict | None = None
        stats = engine.store_stats()
        seq, values = engine.knobs.versioned()
        self._knobs_by_seq: dict[int, KnobValues] = {seq: values}
        self.windows = WindowedMeters(baseline=read_store_counters(engine), on_segment=self._write_segment)
        self.writer = SessionLogWriter(
            path, model=model_record(engine), knobs=values,
            cache={"ram_slots": stats.slots, "gpu_tier": stats.tier_on, "tier_residents": stats.tier_residents},
            append=append, on_error=engine.notice, fingerprint=engine.fingerprint,
            sampling=sampling or GREEDY, tier=engine.tier_options,
        )
        engine.subscribe(self._on_token)
        engine.knobs.subscribe(self._on_knob)

    def _on_token(self, event) -> None:
        self.writer.write_token(event)
        self.windows.add(event)
        self.tokens += 1

    def _on_knob(self, change: KnobChange) -> None:
        previous = self._knobs_by_seq.get(change.seq - 1, self.engine.knobs.snapshot())
        self._knobs_by_seq[change.seq] = dataclasses.replace(previous, **{change.name: change.new})
        self.writer.write_knob_change(change, self.tokens)

    def _knobs_of(self, seq: int) -> KnobValues | None:
        return self._knobs_by_seq.get(seq)

    def _segment_record(self, segment: Segment) -> dict:
        knobs = self._knobs_of(segment.knob_seq)
        meters = dict(segment.meters)
        if knobs is not None:  # the lever's meters are "–" for a setting with the lever off
            if not knobs.CACHE_ROUTE:
                meters.update(swap=None, swaps_to_vram=None)
            if not knobs.meters_on:
                meters.update(route_agree=None, route_kl=None)
        return {"knob_seq": segment.knob_seq, "knobs": knobs.as_dict() if knobs is not None else None,
                "cache_slots": segment.ram_slots, "from_token": segment.first, "to_token": segment.end,
                "meters": _logged(meters)}

    def _write_segment(self, segment: Segment) -> None:
        self.writer.write_segment(self._segment_record(segment))

    def detach(self) -> None:
        """Stop recording; the last setting's segment is written and its meters kept for the summary."""
        if self.meters is None:
            self.engine.unsubscribe(self._on_token)
            self.engine.knobs.unsubscribe(self._on_knob)
            last = self.windows.current()
            self.meters = {}
            if last is not None:
                record = self._segment_record(last)
                self.writer.write_segment(record)
                self.meters = record["meters"]
            self.recorded = _logged(self.windows.summary("total"))

    def close(self, extra: dict | None = None, stream: tuple[list[int], list[int]] | None = None) -> None:
        """Write the token stream (`stream`: prompt ids, generated ids), the summary (the last
        setting's meters, all recorded tokens' meters, `extra`, e.g. ids_match and tf_nll) and close."""
        self.detach()
        if stream is not None:
            self.writer.write_stream(*stream)
        summary = {"meters": self.meters, "recorded": self.recorded, "tokens": self.tokens,
                   "segments": len(self.windows.segments) + (1 if self.windows.setting is not None else 0)}
        summary.update(extra or {})
        self.writer.write_summary(summary)
        self.writer.close()
