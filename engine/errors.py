"""Errors that reach the user as one line, never as a traceback."""

from __future__ import annotations

from pathlib import Path


class TierlabError(Exception):
    """Base class: the message is one line that names the file and the problem."""

    exit_code = 2

    def __init__(self, message: str, path: str | Path | None = None) -> None:
        self.path = None if path is None else str(path)
        super().__init__(f"{path}: {message}" if path is not None else message)


class ModelError(TierlabError):
    """A model folder, checkpoint or container that cannot be loaded."""


class TemplateError(TierlabError):
    """A chat template that fails to render or tries to leave the sandbox."""


class FormatError(TierlabError):
    """A heat file, session log or reference file that is malformed."""


class SettingError(TierlabError, ValueError):
    """A setting out of its range (a sampling flag): one line for the user, and still the
    ValueError that callers checking a value expect."""
