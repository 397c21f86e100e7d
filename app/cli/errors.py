"""The one error boundary: which failures the user caused, and the one line that says so.

Bad input and a troubled environment (a missing file, a full disk, a value
out of range, a template that overflows, bad numbers reaching a compiled
kernel) are the user's to fix: they become one line, and the command exits 2.
Anything else is a bug in tierlab: one line too, exit 1, and with
TIERLAB_DEBUG=1 set every failure is re-raised so its traceback shows.
"""

from __future__ import annotations

import os
import sys
from typing import Callable, Iterator

from jinja2 import TemplateError as JinjaTemplateError

from tierlab.engine.errors import TierlabError
from tierlab.engine.knobs import KnobError

DEBUG_ENV = "TIERLAB_DEBUG"
INPUT_EXIT = 2
BUG_EXIT = 1

#: Failures that bad input or the environment cause (UnicodeError and JSON errors are ValueErrors).
INPUT_ERRORS = (OSError, ValueError, ArithmeticError, RecursionError, MemoryError, JinjaTemplateError)

#: What a compiled (numba) function says when the exception it raised could not be passed on.
KERNEL_FAILED = "returned a result with an exception set"


def debugging() -> bool:
    return os.environ.get(DEBUG_ENV, "").strip() not in ("", "0")


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0].strip() if lines else ""


def _chain(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def _input_line(exc: BaseException) -> str:
    """One line for a failure the user caused, naming the file where the error knows it."""
    if isinstance(exc, OSError):
        problem = exc.strerror or _first_line(exc) or type(exc).__name__
        return f"{exc.filename}: {problem}" if exc.filename is not None else problem
    if isinstance(exc, RecursionError):
        return "input nested too deeply to read (recursion limit)"
    if isinstance(exc, MemoryError):
        return f"out of memory{': ' + _first_line(exc) if _first_line(exc) else ''}"
    if isinstance(exc, JinjaTemplateError):
        return f"template failed: {_first_line(exc)}"
    text = _first_line(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def classify(exc: BaseException) -> tuple[int, str]:
    """(exit code, one line): 2 for input and environment, 1 for a bug."""
    if isinstance(exc, (TierlabError, KnobError)):
        return INPUT_EXIT, _first_line(exc) or type(exc).__name__
    if isinstance(exc, INPUT_ERRORS):
        return INPUT_EXIT, _input_line(exc)
    if isinstance(exc, SystemError) and KERNEL_FAILED in str(exc):
        # The kernel's own exception is chained to this one: name it, it says what the data did.
        inner = next((e for e in _chain(exc) if e is not exc), None)
        detail = _input_line(inner) if inner is not None else "bad numbers in the data"
        return INPUT_EXIT, f"a compiled kernel failed on the data ({detail}); check the model's weights"
    text = _first_line(exc)
    return BUG_EXIT, f"internal error: {type(exc).__name__}{': ' + text if text else ''} " \
                     f"(set {DEBUG_ENV}=1 for the traceback)"


def error_line(exc: BaseException) -> str:
    """The one line the app shows for any failure (it keeps running either way)."""
    return classify(exc)[1]


def run_guarded(action: Callable[[], int]) -> int:
    """Run a command: its exit code, or, on failure, `tierlab: error: ...` on stderr and 2 (1
    for a bug). With TIERLAB_DEBUG set, failures other than TierlabError/KnobError re-raise."""
    try:
        return action()
    except (TierlabError, KnobError) as exc:
        print(f"tierlab: error: {exc}", file=sys.stderr)
        return INPUT_EXIT
    except KeyboardInterrupt:
        print("tierlab: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader (`| head`) has all it wanted
        return 0
    except Exception as exc:
        if debugging():
            raise
        code, line = classify(exc)
        print(f"tierlab: error: {line}", file=sys.stderr)
        return code
