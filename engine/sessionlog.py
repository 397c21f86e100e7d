"""Session logs (``--log FILE``): what a run did, token by token, as JSON lines.

A run writes one header record, then one record per token, a record for
every knob change and, if it ends cleanly, a summary. Each record is one
line, flushed as soon as it is written, so a crash loses at most the token
being written; the reader keeps everything before the damage and says so
once. JSON only: reading a log never runs code from it.

Record shapes (``type`` tells them apart; docs/formats.md "Session log"):

- header: format, version, model, knobs, cache, machine; from version 2
  also fingerprint (engine/fingerprint.py), sampling (temperature, top_p,
  top_k, seed) and tier (the TierOptions the engine was opened with)
- token: index, phase, token, knob_seq, timings_ms, layers[] (layer,
  chosen, true_topk, level, swapped, weights, true_weights, ram_hits,
  ram_misses, vram_served, shadow: [RAM hits, RAM misses, GPU tier] of the
  stock top-K)
- knob: seq, name, old, new, at_token
- segment: one per knob setting, written when the setting ends: knob_seq,
  knobs, cache_slots, from_token, to_token, meters (the setting's own)
- stream: prompt_ids, generated_ids: the token stream of a run, written
  once it ends (version 2), so `tierlab replay` can teacher-force it
- summary: meters of the last knob setting, meters of every recorded token
  ("recorded"), and free-form figures (e.g. ids_match, tf_nll)
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import math
import platform
import threading
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np

from tierlab.engine.bounded_read import LOG_LINE_LIMIT, open_binary, read_line
from tierlab.engine.errors import FormatError
from tierlab.engine.events import LayerRoute, TokenEvent
from tierlab.engine.routing import topk_kl

FORMAT_NAME = "tierlab-session-log"
FORMAT_VERSION = 2
#: Versions this reader reads: 1 lacks the fingerprint, sampling, tier and stream records.
READ_VERSIONS = (1, 2)
# A header line longer than this means the file is something else.
MAX_HEADER_BYTES = 1 << 20


class SessionLogWarning(UserWarning):
    """A log was damaged (truncated or corrupt); the records before it were read."""


def _jsonable(value: Any) -> Any:
    """json.dumps fallback for numpy scalars and arrays, dataclass-like objects and paths."""
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, Path):
        return str(value)
    if hasattr(value, "as_dict"):
        return value.as_dict()
    raise TypeError(f"cannot write {type(value).__name__} to a session log")


def _finite(value: Any) -> Any:
    """Strict JSON has no NaN or infinity: they are written as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def _weights(values) -> list[float]:
    return [float(f"{float(v):.6g}") for v in np.asarray(values).ravel()]


def _layer_record(route: LayerRoute) -> dict[str, Any]:
    """A routing record as a log line writes it (the meter counts are recomputed when read)."""
    record = {
        "layer": int(route.layer),
        "chosen": np.asarray(route.chosen).astype(int).tolist(),
        "true_topk": np.asarray(route.true_topk).astype(int).tolist(),
        "level": np.asarray(route.level).astype(int).tolist(),
        "swapped": [int(bool(s)) for s in np.asarray(route.swapped).ravel()],
        "weights": _weights(route.weights),
        "ram_hits": int(route.ram_hits),
        "ram_misses": int(route.ram_misses),
        "vram_served": int(route.vram_served),
    }
    if route.shadow_ram_hits or route.shadow_ram_misses or route.shadow_vram:
        record["shadow"] = [int(route.shadow_ram_hits), int(route.shadow_ram_misses), int(route.shadow_vram)]
    true_weights = route.true_weights  # lets the log's KL be recomputed
    if true_weights is not None:
        record["true_weights"] = _weights(true_weights)
    return record


def _route_from_record(record: Mapping[str, Any], measured: bool) -> LayerRoute:
    """A layer record back as a LayerRoute, its meter counts recomputed from the record's fields."""
    chosen = np.asarray(record["chosen"], dtype=np.int32)
    filled = chosen >= 0
    swapped = np.asarray(record["swapped"], dtype=bool) & filled
    level = np.asarray(record["level"], dtype=np.int8)
    true_topk = np.asarray(record["true_topk"], dtype=np.int32)
    weights = np.asarray(record["weights"], dtype=np.float32)
    raw_true = record.get("true_weights")
    true_weights = None if raw_true is None else np.asarray(raw_true, dtype=np.float32)
    kl = None
    if measured and true_weights is not None:
        kl = topk_kl(true_topk, true_weights, chosen, weights)
    shadow = [int(v) for v in record.get("shadow") or (0, 0, 0)]
    return LayerRoute(int(record["layer"]), chosen, weights, true_topk, true_weights, level, swapped,
                      slots=int(filled.sum()), swaps=int(swapped.sum()), swaps_vram=int((swapped & (level == 2)).sum()),
                      measured=measured, kl=kl, ram_hits=int(record.get("ram_hits", 0)),
                      ram_misses=int(record.get("ram_misses", 0)), vram_served=int(record.get("vram_served", 0)),
                      shadow_ram_hits=shadow[0], shadow_ram_misses=shadow[1], shadow_vram=shadow[2])


def event_from_record(record: Mapping[str, Any], measured: bool, gpu_tier: bool = False) -> TokenEvent:
    """A token record back as the TokenEvent it was written from, for the meter fold.

    ``measured``: whether the run had its routing meters on (the log's knobs
    say so); ``gpu_tier``: whether the header says a GPU tier was attached.
    """
    return TokenEvent(
        index=int(record["index"]), token_id=int(record.get("token", -1)), phase=str(record.get("phase", "")),
        layers=[_route_from_record(layer, measured) for layer in record["layers"]],
        timings_ms=dict(record.get("timings_ms") or {}), knob_seq=int(record.get("knob_seq", 0)),
        gpu_tier=gpu_tier,
    )


def _tier_record(tier: Any) -> dict[str, Any]:
    if tier is None:
        return {}
    if isinstance(tier, Mapping):
        return dict(tier)
    return {k: getattr(tier, k) for k in ("enabled", "budget", "device", "warmstart", "heat_file")}


def machine_info() -> dict[str, Any]:
    return {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "time": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }


class SessionLogWriter:
    """Appends records to a session log; safe to call from several threads.

    The log is a new file unless ``append`` is set (then this run's header
    and records follow what the file holds; nothing is ever overwritten).
    A write that fails (a full disk, an I/O error) stops the recording: the
    file is cut back to its last whole record, so what was written still
    reads, and ``on_error`` is told once; the run goes on.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        model: Mapping[str, Any],
        knobs: Any,
        cache: Mapping[str, Any] | None = None,
        append: bool = False,
        on_error: Callable[[str], None] | None = None,
        fingerprint: str | None = None,
        sampling: Mapping[str, Any] | None = None,
        tier: Any = None,
    ) -> None:
        """``model``: path, arch and dims; ``knobs``: a KnobValues or dict;
        ``cache``: e.g. ``{"ram_slots": 64, "gpu_tier": True}`` (ram_slots feeds the Belady oracle);
        ``fingerprint``: the model's (engine/fingerprint.py); ``sampling``: temperature, top_p,
        top_k, seed; ``tier``: a TierOptions or dict."""
        self.path = Path(path)
        self._lock = threading.Lock()
        self._on_error = on_error
        self.failed: str | None = None  # why recording stopped, if it did
        try:
            self._file = open(self.path, "a" if append else "x", encoding="utf-8")
        except FileExistsError:
            raise FormatError("session log exists (use --append to add to it, or name a new file)", self.path) from None
        except OSError as exc:
            raise FormatError(f"cannot write session log: {exc.strerror}", self.path) from None
        self._good = os.fstat(self._file.fileno()).st_size  # the end of the last whole record
        knob_dict = knobs.as_dict() if hasattr(knobs, "as_dict") else dict(knobs)
        self._write(
            {
                "type": "header",
                "format": FORMAT_NAME,
                "version": FORMAT_VERSION,
                "model": dict(model),
                "knobs": knob_dict,
                "cache": dict(cache or {}),
                "machine": machine_info(),
                "fingerprint": fingerprint,
                "sampling": dict(sampling or {}),
                "tier": _tier_record(tier),
            }
        )

    def _write(self, record: Mapping[str, Any]) -> None:
        try:
            line = json.dumps(record, default=_jsonable, separators=(",", ":"), allow_nan=False)
        except ValueError:  # a NaN somewhere: rare, so only then the slower pass
            plain = json.loads(json.dumps(record, default=_jsonable))
            line = json.dumps(_finite(plain), separators=(",", ":"), allow_nan=False)
        with self._lock:
            if self._file.closed:
                return
            try:
                self._file.write(line + "\n")
                self._file.flush()
                self._good += len(line) + 1  # json.dumps writes ASCII: one byte per character
            except OSError as exc:
                self._stop(exc)

    def _stop(self, exc: OSError) -> None:
        """Cut the file back to its last whole record, close it and say so once."""
        self.failed = exc.strerror or str(exc)
        fd = self._file.fileno()
        try:
            os.ftruncate(fd, self._good)
        except OSError:
            pass
        try:  # the unwritten rest of the buffer goes nowhere when the file closes
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, fd)
            os.close(null)
        except OSError:
            pass
        try:
            self._file.close()
        except (OSError, ValueError):
            pass
        if self._on_error is not None:
            self._on_error(f"{self.path}: session log stopped ({self.failed}); "
                           "the records written before it are kept")

    def write_token(self, event: TokenEvent) -> None:
        self._write(
            {
                "type": "token",
                "index": int(event.index),
                "phase": event.phase,
                "token": int(event.token_id),
                "knob_seq": int(event.knob_seq),
                "timings_ms": {k: round(float(v), 4) for k, v in event.timings_ms.items()},
                "layers": [_layer_record(route) for route in event.layers],
            }
        )

    def write_knob_change(self, change: Any, token_index: int) -> None:
        """``change`` is a knobs.KnobChange; ``token_index`` the first token it applies to."""
        self._write(
            {
                "type": "knob",
                "seq": int(change.seq),
                "name": change.name,
                "old": change.old,
                "new": change.new,
                "at_token": int(token_index),
            }
        )

    def write_segment(self, segment: Mapping[str, Any]) -> None:
        """One knob setting's record: its knobs, cache size, token range and meters."""
        self._write({"type": "segment", **segment})

    def write_stream(self, prompt_ids, generated_ids) -> None:
        """The run's token stream: the prompt and every token it produced."""
        self._write({"type": "stream", "prompt_ids": [int(t) for t in prompt_ids],
                     "generated_ids": [int(t) for t in generated_ids]})

    def write_summary(self, summary: Mapping[str, Any]) -> None:
        self._write({"type": "summary", **summary})

    def close(self) -> None:
        with self._lock:
            if self._file.closed:
                return
            try:
                self._file.close()
            except OSError as exc:
                self._stop(exc)

    def __enter__(self) -> "SessionLogWriter":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass
class SessionLog:
    """A log as read back; ``damage`` says why reading stopped early (None if it did not)."""

    path: str
    header: dict[str, Any]
    tokens: list[dict[str, Any]] = field(default_factory=list)
    knob_changes: list[dict[str, Any]] = field(default_factory=list)
    segments: list[dict[str, Any]] = field(default_factory=list)
    summary: dict[str, Any] | None = None
    damage: str | None = None
    stream: dict[str, Any] | None = None  # prompt_ids and generated_ids (version 2)

    @property
    def version(self) -> int:
        return int(self.header.get("version", 1))

    @property
    def fingerprint(self) -> str | None:
        """The model's fingerprint, None in a version-1 log."""
        value = self.header.get("fingerprint")
        return value if isinstance(value, str) else None


_REQUIRED = {"token": ("index", "layers"), "knob": ("name", "at_token"), "summary": (),
             "stream": ("prompt_ids", "generated_ids")}


def _parse_line(raw: bytes) -> dict[str, Any] | None:
    """One record, or None when the line is not a well-formed record."""
    try:
        record = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        return None
    if not isinstance(record, dict) or not isinstance(record.get("type"), str):
        return None
    required = _REQUIRED.get(record["type"], ())
    if any(key not in record for key in required):
        return None
    if record["type"] == "token" and not isinstance(record["layers"], list):
        return None
    if record["type"] == "stream" and not all(
        isinstance(record[k], list) and all(isinstance(t, int) and not isinstance(t, bool) for t in record[k])
        for k in ("prompt_ids", "generated_ids")
    ):
        return None
    return record


def _read_header(path: Path, first: bytes) -> dict[str, Any]:
    if not first:
        raise FormatError("empty file, not a tierlab session log", path)
    header = _parse_line(first) if first.endswith(b"\n") or len(first) < MAX_HEADER_BYTES else None
    if header is None or header.get("type") != "header" or header.get("format") != FORMAT_NAME:
        raise FormatError("not a tierlab session log", path)
    version = header.get("version")
    if version not in READ_VERSIONS:
        shown = " and ".join(str(v) for v in READ_VERSIONS)
        raise FormatError(f"session log version {version!r}; this tierlab reads versions {shown}", path)
    return header


def read_session_log(path: str | os.PathLike) -> SessionLog:
    """Read a log up to its first damaged line (one SessionLogWarning if there is one).

    Raises FormatError (one line, names the file) for a file that is missing,
    not a session log, or of another format version.
    """
    path = Path(path)
    with open_binary(path, "session log", FormatError) as handle:
        header = _read_header(path, handle.readline(MAX_HEADER_BYTES))
        log = SessionLog(str(path), header)
        line_no = 1
        while True:
            raw, whole = read_line(handle, LOG_LINE_LIMIT, skip=False)  # reading stops at a long line
            line_no += 1
            if not raw:
                break
            if not whole:
                log.damage = f"line {line_no} is longer than {LOG_LINE_LIMIT} bytes"
                break
            if not raw.strip():
                continue
            record = _parse_line(raw)
            if record is None:
                what = "truncated" if not raw.endswith(b"\n") else "damaged"
                log.damage = f"line {line_no} is {what}"
                break
            kind = record["type"]
            if kind == "token":
                log.tokens.append(record)
            elif kind == "knob":
                log.knob_changes.append(record)
            elif kind == "segment":
                log.segments.append(record)
            elif kind == "summary":
                log.summary = record
            elif kind == "stream":
                log.stream = record
            # other types: written by a newer minor revision; skipped
    if log.damage:
        warnings.warn(
            f"{path}: {log.damage}; read the {len(log.tokens)} tokens before it",
            SessionLogWarning,
            stacklevel=2,
        )
    return log
