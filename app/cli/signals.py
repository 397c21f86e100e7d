"""SIGTERM as a clean shutdown for the commands that run the engine.

Python ends a process on SIGTERM without running `finally` blocks, so the
engine's close (which writes HEAT_FILE) would never run. `sigterm_exits`
turns the signal into `SystemExit(143)` (128 + SIGTERM, what a shell reports
for a terminated process): the command's `finally` closes the engine and
the process exits without a traceback. SIGINT already raises
KeyboardInterrupt, which the same `finally` handles. The terminal app runs
an event loop instead: `exit_on_sigterm` makes SIGTERM ask the app to exit,
so its unmount closes the engine the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
from typing import Callable, Iterator

SIGTERM_EXIT = 128 + signal.SIGTERM


def _on_sigterm(signum, frame) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM ends the process at once
    raise SystemExit(SIGTERM_EXIT)


@contextlib.contextmanager
def sigterm_exits() -> Iterator[None]:
    """Within the block SIGTERM raises SystemExit(143); the previous handler comes back after it.

    Only the main thread can set handlers; elsewhere the block runs as it is.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def exit_on_sigterm(exit_app: Callable[[int], None]) -> Callable[[], None]:
    """From the running event loop on, SIGTERM calls `exit_app(143)` once (a second SIGTERM ends
    the process at once); returns what removes the handler. Off the main thread, or where the
    loop cannot take signal handlers, nothing changes."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return lambda: None

    def on_sigterm() -> None:
        remove()
        exit_app(SIGTERM_EXIT)

    def remove() -> None:
        try:
            loop.remove_signal_handler(signal.SIGTERM)
        except (RuntimeError, ValueError):
            pass

    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    try:
        loop.add_signal_handler(signal.SIGTERM, on_sigterm)
    except (NotImplementedError, RuntimeError, ValueError):
        return lambda: None
    return remove
