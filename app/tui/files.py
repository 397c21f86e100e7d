"""Where the app writes what it saves: session logs and heat profiles.

Files go to one folder (``--sessions``, default ``./tierlab-sessions``) with
names that sort by time, so the sessions screen can list them newest first.
Heat profiles are written atomically (engine/atomic.py), so a crash or a
full disk never leaves half of one.
"""

from __future__ import annotations

import datetime as _dt
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tierlab.engine.bounded_read import open_binary, read_line
from tierlab.engine.errors import TierlabError
from tierlab.engine.heat import HeatProfile

LOG_SUFFIX = ".jsonl"
HEAT_SUFFIX = ".heat"


def stamped_path(folder: Path, prefix: str, suffix: str) -> Path:
    """A new file name in `folder` like ``session-20261130-141502.jsonl`` (never an existing one)."""
    folder.mkdir(parents=True, exist_ok=True)
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    path = folder / f"{prefix}-{stamp}{suffix}"
    n = 2
    while path.exists():
        path = folder / f"{prefix}-{stamp}-{n}{suffix}"
        n += 1
    return path


def session_heat(engine) -> HeatProfile:
    """The engine's routing counts so far, as a heat profile."""
    counts = np.array(engine.heat, dtype=np.int64, copy=True)
    return HeatProfile(counts.shape[0], counts.shape[1], counts)


def save_session_heat(engine, path: str | Path | None, folder: Path) -> Path:
    """Write the session's heat to `path` (or a new stamped file in `folder`); returns the path."""
    target = Path(path) if path else stamped_path(folder, "heat", HEAT_SUFFIX)
    if target.parent and not target.parent.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
    session_heat(engine).write(target)
    return target


def list_logs(folder: Path) -> list[Path]:
    """Session logs in `folder`, newest first."""
    if not folder.is_dir():
        return []
    return sorted(folder.glob(f"*{LOG_SUFFIX}"), key=lambda p: (p.stat().st_mtime, p.name), reverse=True)


@dataclass(frozen=True)
class LogListing:
    """What the sessions list shows of a log without reading all of it."""

    path: Path
    knobs: str  # the knobs that differ from their defaults at the start ("lever off" if none), and the RAM cache
    records: int  # lines after the header: tokens, knob changes and the summary
    size: int
    modified: float


def start_label(header: dict) -> str:
    """The knobs at a log's start and its RAM cache: `lever off · cache 16/32`, `CACHE_ROUTE=1 · cache 32/32`."""
    from tierlab.app.lab.abtable import knob_label

    label = knob_label(header.get("knobs") or {})
    cache = header.get("cache") if isinstance(header.get("cache"), dict) else {}
    slots = cache.get("ram_slots")
    if slots is not None:
        model = header.get("model") if isinstance(header.get("model"), dict) else {}
        experts = model.get("n_experts")
        label += f" · cache {slots}/{experts}" if experts else f" · cache {slots}"
    return label


def read_header(path: Path) -> dict:
    """A session log's header line ({} when the file has none)."""
    try:
        with open(path, "rb") as handle:
            header = json.loads(handle.readline(1 << 20).decode("utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return {}
    return header if isinstance(header, dict) and header.get("type") == "header" else {}


def describe_log(path: Path) -> LogListing:
    """Read a log's header line and count its records (a damaged header reads as "not a session log")."""
    stat = path.stat()
    knobs = "not a session log"
    records = 0
    try:
        with open_binary(path, "session log", limit=None) as handle:
            header = json.loads(handle.readline(1 << 20).decode("utf-8"))
            if isinstance(header, dict) and header.get("type") == "header":
                knobs = start_label(header)
            while True:  # line by line in bounded pieces: one huge line is never held whole
                line, _ = read_line(handle)
                if not line:
                    break
                records += bool(line.strip())
    except (TierlabError, OSError, UnicodeDecodeError, ValueError, RecursionError):
        pass
    return LogListing(path, knobs, records, stat.st_size, stat.st_mtime)


def list_heat_files(*folders: Path) -> list[str]:
    """Heat profiles (``*.heat``) in the given folders, for path suggestions."""
    found: list[str] = []
    for folder in folders:
        if folder.is_dir():
            found.extend(str(p) for p in sorted(folder.glob(f"*{HEAT_SUFFIX}")))
    return found
