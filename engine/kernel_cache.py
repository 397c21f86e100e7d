"""Where numba keeps the compiled kernels on disk, chosen before the first kernel is defined.

numba's own default is a `__pycache__` folder next to each source file, checked
against that one file's size and modification time. Two things go wrong with
that: an installed package may sit in a folder the user cannot write (numba
then compiles every kernel again in every process), and a kernel that calls
a kernel or reads a constant from another module keeps the old machine code
when only that other module changed (numba's cache does not follow imports).
Either is a first reply stuck behind minutes of compiling, or a wrong one.

So, unless the user names NUMBA_CACHE_DIR, tierlab points numba at a folder in
the user's cache (XDG_CACHE_HOME or ~/.cache, under tierlab/numba/) named by a
digest of what the kernels are built from: every module that defines a kernel,
the tierlab modules those import, and the settings compiled into them. A
change to any of these starts a fresh folder; an unchanged checkout or install
finds its kernels again. Folders not used for a month are removed.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import sys
import time
from pathlib import Path

#: The environment variable tierlab fills in; a value tierlab did not set is the user's and wins.
ENV = "NUMBA_CACHE_DIR"
#: Set alongside ENV, so a child process (perhaps of another checkout) knows ENV was chosen, not given.
CHOSEN = "TIERLAB_NUMBA_CACHE_DIR"
#: Settings read at import and compiled into kernels (engine/kernels/qmatvec.py).
COMPILED_IN = ("TIERLAB_VNNI",)
#: A cache folder untouched for this long belongs to a checkout or version no longer in use.
STALE_SECONDS = 30 * 24 * 3600

_KERNEL = re.compile(rb"^[ \t]*@(?:numba\.)?n?jit\b", re.MULTILINE)
_IMPORT = re.compile(rb"^[ \t]*(?:from[ \t]+(tierlab(?:\.\w+)*)[ \t]+import|import[ \t]+(tierlab(?:\.\w+)*))",
                     re.MULTILINE)

PACKAGE = Path(__file__).resolve().parents[1]


def package_modules(root: Path = PACKAGE) -> dict[str, Path]:
    """Every module of the package by dotted name (folders without `__init__.py` are not the package's)."""
    found: dict[str, Path] = {}
    for folder, dirs, files in os.walk(root):
        here = Path(folder)
        if not (here / "__init__.py").is_file():
            dirs[:] = []
            continue
        dirs[:] = sorted(d for d in dirs if d != "__pycache__" and not d.startswith("."))
        prefix = ".".join(("tierlab", *here.relative_to(root).parts))
        for name in files:
            if name.endswith(".py"):
                stem = name[:-3]
                found[prefix if stem == "__init__" else f"{prefix}.{stem}"] = here / name
    return found


def kernel_sources(root: Path = PACKAGE) -> dict[str, bytes]:
    """The text numba compiles from: each module that defines a kernel and the tierlab modules it imports."""
    modules = package_modules(root)
    texts = {name: path.read_bytes() for name, path in modules.items()}
    chosen: dict[str, bytes] = {}
    for name, text in texts.items():
        if b"jit" not in text or not _KERNEL.search(text):
            continue
        chosen[name] = text
        for match in _IMPORT.finditer(text):
            imported = (match.group(1) or match.group(2)).decode()
            if imported in texts:
                chosen[imported] = texts[imported]
    return dict(sorted(chosen.items()))


def cache_key(root: Path = PACKAGE, environ=os.environ) -> str:
    """A digest of the kernel sources and the compiled-in settings: equal keys, interchangeable machine code."""
    digest = hashlib.sha256()
    for name, text in kernel_sources(root).items():
        digest.update(name.encode() + b"\0" + hashlib.sha256(text).digest())
    for name in COMPILED_IN:
        digest.update(f"{name}={environ.get(name, '')}".encode() + b"\0")
    digest.update(sys.version.encode())
    return digest.hexdigest()[:16]


def user_cache_root(environ=os.environ) -> Path | None:
    """tierlab/numba in the user's cache folder (XDG_CACHE_HOME, else ~/.cache); None without a home."""
    base = environ.get("XDG_CACHE_HOME")
    if not base:
        try:
            base = str(Path.home() / ".cache")
        except (RuntimeError, KeyError):
            return None
    return Path(base) / "tierlab" / "numba"


def _writable(folder: Path) -> bool:
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".probe-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
        return True
    except OSError:
        return False


def remove_stale(root: Path, keep: Path, now: float | None = None) -> None:
    """Remove the cache folders beside `keep` that no process has used for STALE_SECONDS."""
    now = time.time() if now is None else now
    try:
        entries = list(root.iterdir())
    except OSError:
        return
    for entry in entries:
        try:
            if entry != keep and entry.is_dir() and now - entry.stat().st_mtime > STALE_SECONDS:
                shutil.rmtree(entry, ignore_errors=True)
        except OSError:
            continue


def choose(environ=os.environ) -> str | None:
    """Set NUMBA_CACHE_DIR to this package's keyed folder unless the user set it; the folder in use.

    Returns None (numba keeps its default) when neither the user's cache nor the
    temporary folder can be written."""
    given = environ.get(ENV)
    if given and given != environ.get(CHOSEN):
        return given
    key = cache_key(environ=environ)
    uid = os.getuid() if hasattr(os, "getuid") else "user"
    candidates = [user_cache_root(environ), Path(environ.get("TMPDIR", "/tmp")) / f"tierlab-{uid}" / "numba"]
    for root in candidates:
        if root is None:
            continue
        folder = root / key
        if _writable(folder):
            os.utime(folder)  # in use: remove_stale keeps it
            remove_stale(root, folder)
            environ[ENV] = environ[CHOSEN] = str(folder)
            if environ is os.environ and "numba" in sys.modules:  # numba read its settings already
                from numba.core import config

                config.reload_config()
            return str(folder)
    return None
