"""numba's disk cache: a user folder keyed by the kernels' sources, the user's NUMBA_CACHE_DIR as given."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import tierlab
from tierlab.engine import kernel_cache

PACKAGE = Path(tierlab.__file__).resolve().parent


def copy_package(to: Path) -> Path:
    """The package's modules (no models, tests or caches), as a checkout or install of it holds them."""
    for name, path in kernel_cache.package_modules(PACKAGE).items():
        target = to / path.relative_to(PACKAGE)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, target)
    return to


def test_the_key_covers_kernel_modules_and_their_imports(tmp_path):
    root = copy_package(tmp_path / "tierlab")
    sources = kernel_cache.kernel_sources(root)
    assert {"tierlab.engine.kernels.qmatvec", "tierlab.engine.routing", "tierlab.app.lab.belady"} <= set(sources)
    assert "tierlab.engine.blob_layout" in sources  # no kernel of its own, but its constants are compiled in
    assert "tierlab.app.tui.app" not in sources
    key = kernel_cache.cache_key(root, environ={})
    assert key == kernel_cache.cache_key(root, environ={})
    tui = root / "app" / "tui" / "app.py"
    tui.write_text(tui.read_text() + "\n# not read by any kernel\n")
    assert kernel_cache.cache_key(root, environ={}) == key
    layout = root / "engine" / "blob_layout.py"
    layout.write_text(layout.read_text() + "\n# read by the kernels\n")
    changed = kernel_cache.cache_key(root, environ={})
    assert changed != key
    assert kernel_cache.cache_key(root, environ={"TIERLAB_VNNI": "0"}) != changed


def test_a_user_cache_dir_is_kept(tmp_path):
    env = {"NUMBA_CACHE_DIR": str(tmp_path / "mine"), "XDG_CACHE_HOME": str(tmp_path / "xdg")}
    assert kernel_cache.choose(env) == str(tmp_path / "mine")
    assert env["NUMBA_CACHE_DIR"] == str(tmp_path / "mine") and not (tmp_path / "xdg").exists()


def test_the_keyed_folder_is_chosen_and_old_ones_removed(tmp_path):
    root = tmp_path / "xdg" / "tierlab" / "numba"
    old, recent = root / "0123456789abcdef", root / "fedcba9876543210"
    for folder in (old, recent):
        folder.mkdir(parents=True)
    month_ago = time.time() - kernel_cache.STALE_SECONDS - 60
    os.utime(old, (month_ago, month_ago))
    env = {"XDG_CACHE_HOME": str(tmp_path / "xdg")}
    chosen = kernel_cache.choose(env)
    assert chosen == str(root / kernel_cache.cache_key(environ=env)) and Path(chosen).is_dir()
    assert env["NUMBA_CACHE_DIR"] == env["TIERLAB_NUMBA_CACHE_DIR"] == chosen
    assert not old.exists() and recent.exists()
    assert kernel_cache.choose(env) == chosen  # chosen by tierlab, not given: chosen again the same way


def test_a_fresh_process_caches_its_kernels_in_the_keyed_folder(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("NUMBA_CACHE_DIR", "TIERLAB_NUMBA_CACHE_DIR")}
    env["XDG_CACHE_HOME"] = str(tmp_path)
    probe = ("import tierlab, tierlab.engine.model; from tierlab.engine.warmup import kernels; "
             "print(tierlab.KERNEL_CACHE_DIR); print(*(k.stats.cache_path for k in kernels().values()))")
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    folder, *cache_paths = done.stdout.split()
    assert Path(folder).parent == tmp_path / "tierlab" / "numba"
    assert len(cache_paths) > 20 and all(Path(p).is_relative_to(folder) for p in cache_paths)
