"""`tierlab compare` and the model fingerprint: different models refused or flagged, old logs warned."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import run_cli
from test_sessionlog import OFF, simulate_run

A_MODEL = "sha256:" + "a" * 64
B_MODEL = "sha256:" + "b" * 64


def log_of(path: Path, fingerprint: str | None, version: int = 2) -> Path:
    simulate_run(path, OFF, n_tokens=6)
    lines = path.read_text().splitlines()
    header = json.loads(lines[0])
    header["version"] = version
    if fingerprint is None:
        header.pop("fingerprint", None)
    else:
        header["fingerprint"] = fingerprint
    path.write_text("\n".join([json.dumps(header), *lines[1:]]) + "\n")
    return path


def test_logs_of_one_model_compare_with_a_gate_column(tmp_path):
    a, b = log_of(tmp_path / "a.jsonl", A_MODEL), log_of(tmp_path / "b.jsonl", A_MODEL)
    done = run_cli("compare", str(a), str(b))
    assert done.returncode == 0, done.stderr
    header, *rows = done.stdout.splitlines()
    assert header.rstrip().endswith("gate") and len(rows) == 2 and done.stderr == ""


def test_logs_of_different_models_are_refused_in_one_line(tmp_path):
    a, b = log_of(tmp_path / "a.jsonl", A_MODEL), log_of(tmp_path / "b.jsonl", B_MODEL)
    done = run_cli("compare", str(a), str(b))
    assert done.returncode == 2 and done.stdout == "" and "Traceback" not in done.stderr
    assert done.stderr.strip().count("\n") == 0 and "different models" in done.stderr
    assert "aaaaaaaaaaaa" in done.stderr and "bbbbbbbbbbbb" in done.stderr


def test_different_models_are_flagged_when_allowed(tmp_path):
    a, b = log_of(tmp_path / "a.jsonl", A_MODEL), log_of(tmp_path / "b.jsonl", B_MODEL)
    done = run_cli("compare", str(a), str(b), "--allow-different-models")
    assert done.returncode == 0, done.stderr
    rows = done.stdout.splitlines()[1:]
    assert "[model aaaaaaaaaaaa]" in rows[0] and "[model bbbbbbbbbbbb]" in rows[1]


def test_an_old_log_without_a_fingerprint_gets_one_warning_line(tmp_path):
    old, new = log_of(tmp_path / "old.jsonl", None, version=1), log_of(tmp_path / "new.jsonl", A_MODEL)
    done = run_cli("compare", str(old), str(new))
    assert done.returncode == 0, done.stderr
    assert done.stderr.count("\n") == 1 and "warning" in done.stderr and "old.jsonl" in done.stderr
    assert "fingerprint" in done.stderr
