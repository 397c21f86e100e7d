"""Shared pieces of the fuzz suite: running the CLI in-process and the "refused cleanly" check."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from conftest import REPO
from tierlab.app.cli.main import main as cli_main

MODEL = REPO / "assets" / "tiny-moe"

#: every fuzz test: a modest number of cases, no per-case deadline (a cold numba compile is slow)
FUZZ = settings(max_examples=30, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

#: JSON values of every type, including the awkward ones (huge, negative, non-finite, nested)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.sampled_from([10**400, -1, 0, 2**63])
    | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)


def run(capsys, *argv: str) -> tuple[int, str, str]:
    """The real CLI, through the entry the console script uses."""
    capsys.readouterr()
    code = cli_main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def error_lines(err: str) -> list[str]:
    """stderr without progress: the kernel compile a cold run reports, convert's progress bar."""
    return [line for line in err.splitlines()
            if line.strip() and not line.startswith(("tierlab: compiling kernels", "["))]


def assert_refused(code: int, err: str, *needles: str) -> str:
    """Exit 2, one line, no traceback; the line names what it is told to."""
    lines = error_lines(err)
    assert code == 2, (code, err)
    assert "Traceback" not in err, err
    assert len(lines) == 1 and lines[0].startswith("tierlab: error: "), err
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def assert_clean(code: int, err: str) -> None:
    """Either accepted (0) or refused cleanly (2): never a traceback or a bug exit."""
    assert "Traceback" not in err, err
    if code != 0:
        assert_refused(code, err)


def json_dump(value) -> str:
    """JSON as Python writes it, NaN and infinity included (what a careless writer produces)."""
    return json.dumps(value, allow_nan=True)


def header_of(path: Path) -> tuple[dict, bytes]:
    """A safetensors file's header (as parsed) and its data bytes."""
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8:8 + n]), data[8 + n:]


def write_safetensors(path: Path, header_text: bytes, body: bytes | int, length: int | None = None) -> None:
    """A safetensors file; a `body` given as a byte count is a hole of zeros (nothing written, for speed)."""
    blob = header_text + b" " * (-len(header_text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob) if length is None else length) + blob)
        if isinstance(body, int):
            f.truncate(f.tell() + body)
        else:
            f.write(body)


def model_folder(dst: Path, src: Path = MODEL, files=("config.json", "tokenizer.json", "tokenizer_config.json"),
                 weights: bool = True) -> Path:
    """A copy of a model folder (the weights too, unless `weights` is False: a test may corrupt any file)."""
    dst.mkdir(parents=True, exist_ok=True)
    for name in files:
        if (src / name).exists():
            shutil.copy2(src / name, dst / name)
    if weights:
        shutil.copy2(src / "model.safetensors", dst / "model.safetensors")
    return dst
