"""Recording a session log from the app (``ctrl+r`` / ``r``).

The recording itself is the engine's `EngineLog` (the same one `--log`
uses), so a log from the app reads like any other. This module only names
the file and adds the one change the engine does not see as a knob: the RAM
cache size.
"""

from __future__ import annotations

from pathlib import Path

from tierlab.app.tui.files import LOG_SUFFIX, stamped_path
from tierlab.engine.knobs import KnobChange
from tierlab.engine.session import EngineLog


class Recorder:
    """An open session log in the sessions folder."""

    def __init__(self, engine, path: Path) -> None:
        self.path = path
        self.log = EngineLog(engine, path)

    def note_setting(self, name: str, old: object, new: object) -> None:
        """A change that is not a routing knob (the RAM cache size), logged like one at the next token."""
        self.log.writer.write_knob_change(KnobChange(0, name, old, new), self.log.tokens)

    def stop(self) -> Path:
        """Stop listening, write the meters as the summary and close the file."""
        self.log.close()
        return self.path


def start_recording(engine, folder: Path) -> Recorder:
    """Open a new log in `folder`; every token and knob change from now on goes into it."""
    return Recorder(engine, stamped_path(Path(folder), "session", LOG_SUFFIX))
