"""Writing a file so that it is never clobbered: a temp file in the same folder, then a rename.

A reader (or a crash, or a full disk) sees the old file or the new one,
never half of one. A rewrite keeps the file's mode; a new file gets the
mode `open` would give it (0666 less the umask). Temp names carry the
writer's pid, so two processes never share one, and a temp left by a
process that died is removed by the next write of the same file.

`locked(path)` serialises writers of one file across processes with
`fcntl.flock` on a sibling ``FILE.lock``, so the file itself can still be
replaced by a rename while the lock is held (the lock file stays in place:
removing it would let two writers lock two different files).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
from pathlib import Path
from typing import BinaryIO, Callable, Iterator

TEMP_SUFFIX = ".tmp"
LOCK_SUFFIX = ".lock"


def _new_file_mode() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def _temp_prefix(path: Path) -> str:
    return f".{path.name}."


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # exists, owned by someone else
        return True
    return True


def remove_stale_temps(path: str | os.PathLike) -> int:
    """Remove temp files of `path` left by processes that no longer run; returns how many."""
    path = Path(path)
    folder = path.parent
    removed = 0
    prefix = _temp_prefix(path)
    try:
        names = [n for n in os.listdir(folder or ".") if n.startswith(prefix) and n.endswith(TEMP_SUFFIX)]
    except OSError:
        return 0
    for name in names:
        parts = name[len(prefix):-len(TEMP_SUFFIX)].split(".")  # PID.RANDOM: mkstemp's part has no dot
        if len(parts) != 2 or not parts[0].isdigit():
            continue  # another file's temp (e.g. of NAME.7) or not a temp of ours
        pid = int(parts[0])
        if pid == os.getpid() or _pid_alive(pid):
            continue
        try:
            os.unlink(folder / name)
            removed += 1
        except OSError:
            pass
    return removed


def write_atomic(path: str | os.PathLike, data: bytes | str | Callable[[BinaryIO], None]) -> Path:
    """Write `data` (bytes, text as UTF-8, or a callback that writes to the open binary file) to `path`.

    Raises OSError as the write raised it; on any failure the old file is
    untouched and the temp file is gone.
    """
    path = Path(path)
    folder = path.parent if str(path.parent) else Path(".")
    try:
        mode = os.stat(path).st_mode & 0o7777
    except FileNotFoundError:
        mode = _new_file_mode()
    remove_stale_temps(path)
    fd, tmp = tempfile.mkstemp(prefix=f"{_temp_prefix(path)}{os.getpid()}.", suffix=TEMP_SUFFIX, dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            if callable(data):
                data(f)
            else:
                f.write(data.encode("utf-8") if isinstance(data, str) else data)
            f.flush()
            os.fchmod(f.fileno(), mode)
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_dir(folder)
    return path


@contextlib.contextmanager
def locked(path: str | os.PathLike) -> Iterator[None]:
    """Hold an exclusive lock on `path` (through ``path.lock``) for the block; blocks until it is free."""
    lock_path = Path(str(path) + LOCK_SUFFIX)
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def _fsync_dir(directory: Path) -> None:
    """Make the rename itself durable; not every filesystem allows it, which is harmless."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
