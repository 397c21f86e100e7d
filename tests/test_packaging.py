"""A built wheel (what `pip install .` installs) ships the models and the stylesheet and runs from anywhere."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def unpacked_wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    # a copy of the source, so the build's own folders (build/, *.egg-info) never land in the checkout
    source = out / "source"
    shutil.copytree(REPO, source, ignore=shutil.ignore_patterns(".git", ".venv", "build", "*.egg-info", "__pycache__",
                                                                 ".hypothesis", "tierlab-sessions"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out),
                    str(source)], check=True, capture_output=True, timeout=300)
    (wheel,) = out.glob("tierlab-*.whl")
    site = out / "site"
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        z.extractall(site)
    for shipped in ("tierlab/assets/tiny-moe/config.json", "tierlab/assets/tiny-moe/model.safetensors",
                    "tierlab/assets/tiny-moe/tokenizer.json", "tierlab/assets/tiny-moe-8x2/model.safetensors",
                    "tierlab/app/tui/tierlab.tcss", "tierlab/app/cli/main.py", "tierlab/app/lab/belady.py"):
        assert shipped in names, f"the wheel lacks {shipped}"
    assert not any(n.startswith("tierlab/tests/") for n in names)
    return site


def _run(site: Path, cwd: Path, *args: str, cache: Path | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(site))
    if cache is not None:  # a user who set no NUMBA_CACHE_DIR, with this as their cache folder
        env = {k: v for k, v in env.items() if k not in ("NUMBA_CACHE_DIR", "TIERLAB_NUMBA_CACHE_DIR")}
        env["XDG_CACHE_HOME"] = str(cache)
    return subprocess.run([sys.executable, "-m", "tierlab", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)


def test_the_wheel_generates_on_its_shipped_model_from_another_directory(unpacked_wheel, tmp_path):
    where = _run(unpacked_wheel, tmp_path, "--version")
    assert where.returncode == 0 and where.stdout.strip() == "tierlab 0.1.0"
    probe = subprocess.run([sys.executable, "-c", "import tierlab; print(tierlab.__file__)"], cwd=tmp_path,
                           env=dict(os.environ, PYTHONPATH=str(unpacked_wheel)), capture_output=True, text=True)
    assert probe.stdout.strip() == str(unpacked_wheel / "tierlab" / "__init__.py")
    result = _run(unpacked_wheel, tmp_path, "generate", "--prompt", "Once upon a time", "-n", "3", "--json",
                  cache=tmp_path / "cache")
    assert result.returncode == 0, result.stderr
    assert '"text"' in result.stdout
    assert "compiling kernels" in result.stderr  # a new install: nothing cached yet
    kept = list((tmp_path / "cache" / "tierlab" / "numba").glob("*/**/*.nbi"))
    assert kept and not list((unpacked_wheel / "tierlab").glob("**/*.nbi"))  # the user's cache, not the install
    again = _run(unpacked_wheel, tmp_path, "generate", "--prompt", "Once upon a time", "-n", "3", "--json",
                 cache=tmp_path / "cache")
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["text"] == json.loads(result.stdout)["text"]
    assert "compiling kernels" not in again.stderr  # every kernel came from the user's cache
