"""Knob presets: named sets of routing knobs, as plain files in the sessions folder.

A preset is ``SESSIONS/presets/NAME.preset``: one ``KNOB=VALUE`` per line
(the names and values of engine/knobs.py, as the environment takes them),
``#`` starts a comment, and a knob the file does not name takes its default,
so loading a preset sets every knob. Saving writes only the knobs that
differ from their defaults, atomically (engine/atomic.py). Three presets
ship and are written into the folder the first time it is listed: `stock`
(the lever off), `recommended` (the seed's ``CACHE_ROUTE=1 ROUTE_J=2
ROUTE_M=12``) and `aggressive` (``CACHE_ROUTE=1 ROUTE_J=1 ROUTE_M=16``).
A file that does not read as a preset raises `PresetError`, one line that
names the file and the problem.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from tierlab.engine.atomic import write_atomic
from tierlab.engine.errors import TierlabError
from tierlab.engine.knobs import SPEC_BY_NAME, SPECS, KnobError, KnobValues, parse_value

PRESET_SUFFIX = ".preset"
PRESET_FOLDER = "presets"
MAX_PRESET_BYTES = 64 * 1024
"""A preset is a few lines; a larger file is not one (and is not read whole)."""
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")

SHIPPED: dict[str, tuple[str, dict[str, str]]] = {
    "stock": ("the lever off: every knob at its default", {}),
    "recommended": ("the seed's recommended setting", {"CACHE_ROUTE": "1", "ROUTE_J": "2", "ROUTE_M": "12"}),
    "aggressive": ("one true expert kept, resident ones preferred over a wider window",
                   {"CACHE_ROUTE": "1", "ROUTE_J": "1", "ROUTE_M": "16"}),
}
"""The presets that ship: name -> (description, knobs that differ from their defaults)."""


class PresetError(TierlabError):
    """A preset name or file that cannot be used (one line, names the file)."""


@dataclasses.dataclass(frozen=True)
class Preset:
    name: str
    path: Path
    values: KnobValues  # every knob, as loading the preset sets them
    description: str = ""

    @property
    def assignments(self) -> str:
        """`CACHE_ROUTE=1 ROUTE_J=2`: the knobs that differ from their defaults ("lever off" if none)."""
        changed = self.values.changed_from_default()
        return " ".join(f"{k}={format_value(v)}" for k, v in changed.items()) or "lever off"


def format_value(value: object) -> str:
    """A knob value as the environment (and a preset file) writes it."""
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def preset_folder(sessions_dir: str | Path) -> Path:
    return Path(sessions_dir) / PRESET_FOLDER


def check_name(name: str) -> str:
    name = name.strip()
    if not NAME_PATTERN.fullmatch(name):
        raise PresetError(f"preset name {name!r}: use 1-64 letters, digits, '_', '-' or '.', "
                          "starting with a letter or digit")
    return name


def preset_text(values: KnobValues, description: str = "") -> str:
    """A preset file's text for `values`."""
    lines = ["# tierlab knob preset: KNOB=VALUE per line; knobs not named here take their defaults"]
    if description:
        lines.append(f"# {description}")
    lines += [f"{k}={format_value(v)}" for k, v in values.changed_from_default().items()]
    return "\n".join(lines) + "\n"


def parse_preset(text: str, source: str) -> tuple[KnobValues, str]:
    """Every knob's value from a preset's text, and its description (first comment after the header)."""
    updates: dict[str, object] = {}
    comments: list[str] = []
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line:
            continue
        if line.startswith("#"):
            comments.append(line.lstrip("#").strip())
            continue
        name, sep, value = line.partition("=")
        name = name.strip()
        if not sep:
            raise PresetError(f"{source}: line {number}: {line[:40]!r} is not KNOB=VALUE")
        spec = SPEC_BY_NAME.get(name)
        if spec is None:
            raise PresetError(f"{source}: line {number}: unknown knob {name[:40]!r}")
        if name in updates:
            raise PresetError(f"{source}: line {number}: {name} is set twice")
        try:
            updates[name] = parse_value(spec, value)
        except KnobError as exc:
            raise PresetError(f"{source}: line {number}: {exc}") from None
    description = comments[1] if len(comments) > 1 else ""
    return dataclasses.replace(KnobValues(), **updates), description


def read_preset(path: str | Path) -> Preset:
    """Read and check one preset file."""
    path = Path(path)
    try:
        with open(path, "rb") as handle:
            data = handle.read(MAX_PRESET_BYTES + 1)
    except OSError as exc:
        raise PresetError(f"{path}: {exc.strerror or exc}") from None
    if len(data) > MAX_PRESET_BYTES:
        raise PresetError(f"{path}: larger than {MAX_PRESET_BYTES // 1024} KiB: not a preset")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise PresetError(f"{path}: not UTF-8 text") from None
    values, description = parse_preset(text, str(path))
    return Preset(path.stem, path, values, description)


def write_preset(folder: str | Path, name: str, values: KnobValues, description: str = "") -> Path:
    """Save `values` as preset `name` in `folder` (atomically; an existing preset of that name is replaced)."""
    name = check_name(name)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    return write_atomic(folder / f"{name}{PRESET_SUFFIX}", preset_text(values, description))


def ship_presets(folder: str | Path) -> None:
    """Write the shipped presets that the folder lacks (a preset the user changed is left alone)."""
    folder = Path(folder)
    for name, (description, knobs) in SHIPPED.items():
        if not (folder / f"{name}{PRESET_SUFFIX}").exists():
            values = dataclasses.replace(KnobValues(), **{k: parse_value(SPEC_BY_NAME[k], v) for k, v in knobs.items()})
            write_preset(folder, name, values, description)


def list_presets(folder: str | Path) -> tuple[list[Preset], list[str]]:
    """The presets in `folder` (the shipped ones written first), by name, and one line per file that is not one."""
    folder = Path(folder)
    ship_presets(folder)
    found, problems = [], []
    for path in sorted(folder.glob(f"*{PRESET_SUFFIX}")):
        try:
            found.append(read_preset(path))
        except PresetError as exc:
            problems.append(str(exc))
    return found, problems


def find_preset(folder: str | Path, name: str) -> Preset:
    """Preset `name` of `folder` (the shipped ones are written first if missing)."""
    name = check_name(name)
    folder = Path(folder)
    ship_presets(folder)
    path = folder / f"{name}{PRESET_SUFFIX}"
    if not path.exists():
        raise PresetError(f"{path}: no such preset")
    return read_preset(path)


def apply_preset(knobs, preset: Preset) -> list:
    """Set every knob to the preset's value (from the next token); returns the changes made."""
    changes = []
    for spec in SPECS:
        change = knobs.set(spec.name, getattr(preset.values, spec.name))
        if change is not None:
            changes.append(change)
    return changes
