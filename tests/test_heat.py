"""Heat profiles: file format, planning, summaries, diff, the `tierlab heat` CLI, and the warmstart simulation."""

from __future__ import annotations

import math
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tierlab.engine.errors import FormatError
from tierlab.engine.heat import HeatProfile, diff, from_routes, index_order, summarize_counts
from tierlab.app.lab.plan import compare_warmstarts, synthetic_trace, trace_heat

PYTHON = sys.executable  # the venv running the tests (/work/main/.venv/bin/python under `make test`)
MAGIC = 0x51544831  # the format's magic, written out here so that a change to the engine's constant fails


def known_profile() -> HeatProfile:
    heat = HeatProfile(2, 4)
    heat.counts[0] = [6, 2, 1, 1]  # concentrated
    heat.counts[1] = [5, 5, 5, 5]  # uniform
    return heat


def raw(words: list[int], extra: bytes = b"") -> bytes:
    return struct.pack(f"<{len(words)}I", *words) + extra


def tierlab(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([PYTHON, "-m", "tierlab", *args], capture_output=True, text=True, cwd=cwd, timeout=120)


# --- format ---------------------------------------------------------------


def test_round_trip_and_byte_layout(tmp_path):
    heat = HeatProfile(3, 5)
    heat.add(0, [1, 2])
    heat.add(0, [2, -1])  # -1 is an unfilled slot
    heat.add(2, np.array([4, 0]))
    path = tmp_path / "heat.bin"
    heat.write(path)
    data = path.read_bytes()
    assert len(data) == 4 * (3 + 15)
    assert struct.unpack("<3I", data[:12]) == (MAGIC, 3, 5)
    assert struct.unpack("<5I", data[12:32]) == (0, 1, 2, 0, 0)  # layer 0 first
    back = HeatProfile.read(path, n_layers=3, n_experts=5)
    assert np.array_equal(back.counts, heat.counts) and back.counts.dtype == np.int64


def test_exact_bytes_of_a_one_layer_two_expert_profile(tmp_path):
    heat = HeatProfile(1, 2)
    heat.counts[0] = [3, 258]
    want = b"1HTQ" b"\x01\x00\x00\x00" b"\x02\x00\x00\x00" b"\x03\x00\x00\x00" b"\x02\x01\x00\x00"
    assert heat.to_bytes() == want
    path = tmp_path / "heat.bin"
    heat.write(path)
    assert path.read_bytes() == want
    path.write_bytes(want)
    assert HeatProfile.read(path).counts.tolist() == [[3, 258]]


def test_atomic_write_leaves_no_temp_files_and_replaces(tmp_path):
    path = tmp_path / "heat.bin"
    known_profile().write(path)
    other = HeatProfile(2, 4)
    other.add(1, [3])
    other.write(path)
    assert os.listdir(tmp_path) == ["heat.bin"]
    assert HeatProfile.read(path).counts[1, 3] == 1


def test_failed_write_removes_its_temp_file(tmp_path, monkeypatch):
    def broken_fsync(fd):
        raise OSError(5, "I/O error")

    monkeypatch.setattr(os, "fsync", broken_fsync)
    with pytest.raises(OSError):
        known_profile().write(tmp_path / "heat.bin")
    assert os.listdir(tmp_path) == []


MALFORMED = {
    "empty": b"",
    "short_header": raw([MAGIC, 2]),
    "garbage": b"this is not a heat profile at all!!",
    "bad_magic": raw([0x12345678, 2, 4] + [0] * 8),
    "truncated": raw([MAGIC, 2, 4] + [0] * 7),
    "trailing": raw([MAGIC, 2, 4] + [0] * 8, b"\x00"),
    "zero_dims": raw([MAGIC, 0, 4]),
    "huge_dims": raw([MAGIC, 2**31, 2**31]),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_files_are_one_line_format_errors(tmp_path, case):
    path = tmp_path / f"{case}.bin"
    path.write_bytes(MALFORMED[case])
    with pytest.raises(FormatError) as err:
        HeatProfile.read(path)
    message = str(err.value)
    assert "\n" not in message and str(path) in message


def test_dims_are_checked_against_the_model(tmp_path):
    path = tmp_path / "heat.bin"
    known_profile().write(path)
    HeatProfile.read(path, 2, 4)
    with pytest.raises(FormatError, match="2 layers x 4 experts"):
        HeatProfile.read(path, 3, 4)
    with pytest.raises(FormatError):
        HeatProfile.read(path, n_experts=8)


def test_missing_file_is_a_format_error(tmp_path):
    with pytest.raises(FormatError, match="not found"):
        HeatProfile.read(tmp_path / "nope.bin")


def test_counts_saturate_at_the_uint32_limit():
    heat = HeatProfile(1, 2, np.array([[2**40, 3]]))
    back = HeatProfile.from_bytes(heat.to_bytes())
    assert back.counts.tolist() == [[2**32 - 1, 3]]


# --- planning -------------------------------------------------------------


def test_plan_is_hottest_first_across_layers_with_ties_by_layer_then_expert():
    heat = HeatProfile(3, 4)
    heat.counts[:] = [[1, 9, 0, 4], [4, 0, 9, 2], [0, 4, 0, 4]]
    assert heat.plan(7) == [(0, 1), (1, 2), (0, 3), (1, 0), (2, 1), (2, 3), (1, 3)]
    assert len(heat.plan(100)) == 12 and heat.plan(0) == []


def test_index_order_fills_whole_layers_from_layer_zero():
    assert index_order(3, 4, 6) == [(0, 0), (0, 1), (0, 2), (0, 3), (1, 0), (1, 1)]
    assert len(index_order(3, 4, 99)) == 12


# --- summaries and diff ---------------------------------------------------


def test_summaries_of_a_known_profile():
    concentrated, uniform = known_profile().summaries(top=2)
    assert concentrated.routings == 10 and concentrated.top == [(0, 6), (1, 2)]
    p = np.array([0.6, 0.2, 0.1, 0.1])
    assert concentrated.entropy_nats == pytest.approx(float(-(p * np.log(p)).sum()))
    assert concentrated.entropy_norm == pytest.approx(concentrated.entropy_nats / math.log(4))
    assert (concentrated.cover50, concentrated.cover90) == (1, 3)
    assert uniform.entropy_norm == pytest.approx(1.0)
    assert (uniform.cover50, uniform.cover90) == (2, 4)
    assert uniform.top == [(0, 5), (1, 5)]  # ties by expert id


def test_summary_of_an_unrouted_layer():
    s = summarize_counts(0, np.zeros(8, dtype=np.int64))
    assert (s.routings, s.top, s.entropy_nats, s.cover50) == (0, [], 0.0, 0)


def test_diff_identical_disjoint_and_empty_layers():
    a = HeatProfile(3, 4)
    b = HeatProfile(3, 4)
    a.counts[0] = b.counts[0] = [3, 1, 0, 0]
    a.counts[1], b.counts[1] = [1, 1, 0, 0], [0, 0, 1, 1]
    a.counts[2] = [1, 0, 0, 0]  # b's layer 2 never routed
    same, disjoint, empty = diff(a, b, top=2)
    assert (same.top_overlap, same.tvd, same.js) == (1.0, 0.0, 0.0)
    assert disjoint.top_overlap == 0.0 and disjoint.tvd == pytest.approx(1.0)
    assert disjoint.js == pytest.approx(math.log(2))
    assert math.isnan(empty.tvd)
    with pytest.raises(FormatError):
        diff(a, HeatProfile(3, 5))


def test_from_routes_counts_a_trace():
    heat = from_routes(2, 4, [[[0, 1], [2, 3]], [[0, 2], [2, -1]]])
    assert heat.counts.tolist() == [[2, 1, 1, 0], [0, 0, 2, 1]]


# --- the CLI ----------------------------------------------------------------


@pytest.mark.parametrize("case", ["garbage", "truncated", "bad_magic", "empty"])
def test_cli_show_rejects_a_bad_file_with_one_line_and_exit_2(tmp_path, case):
    bad = tmp_path / "BAD.bin"
    bad.write_bytes(MALFORMED[case])
    result = tierlab("heat", "show", str(bad), cwd=tmp_path)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tierlab: error:") and "BAD.bin" in lines[0]
    assert "Traceback" not in result.stderr


def test_cli_show_prints_layers_and_checks_the_model(tmp_path):
    path = tmp_path / "heat.bin"
    known_profile().write(path)
    result = tierlab("heat", "show", str(path), "--top", "2", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "2 layers x 4 experts, 30 routings" in result.stdout
    assert "0(60.0%) 1(20.0%)" in result.stdout
    model = tmp_path / "model"
    model.mkdir()
    sizes = '"hidden_size": 64, "num_attention_heads": 4, "num_experts_per_tok": 2, "vocab_size": 256, "moe_intermediate_size": 32'
    (model / "config.json").write_text('{"text_config": {"model_type": "qwen3_5_moe_text", "num_hidden_layers": 2, "num_experts": 4, '
                                       + sizes + '}}')
    assert tierlab("heat", "show", str(path), "--model", str(model), cwd=tmp_path).returncode == 0
    (model / "config.json").write_text('{"model_type": "qwen3_moe", "num_hidden_layers": 3, "num_local_experts": 4, ' + sizes + '}')
    result = tierlab("heat", "show", str(path), "--model", str(model), cwd=tmp_path)
    assert result.returncode == 2 and "model has 3 x 4" in result.stderr
    result = tierlab("heat", "show", str(path), "--model", str(tmp_path / "nomodel"), cwd=tmp_path)
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1


def test_cli_diff(tmp_path):
    a, b = tmp_path / "a.bin", tmp_path / "b.bin"
    known_profile().write(a)
    known_profile().write(b)
    result = tierlab("heat", "diff", str(a), str(b), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "mean    1.00  0.000  0.000" in result.stdout
    HeatProfile(3, 4).write(b)
    assert tierlab("heat", "diff", str(a), str(b), cwd=tmp_path).returncode == 2


# --- warmstart simulation -------------------------------------------------------


def test_heat_planned_warmstart_beats_index_order_on_a_skewed_trace():
    layers, experts, k = 12, 64, 4
    budget = layers * experts // 3
    trace = synthetic_trace(200, layers, experts, k, skew=1.2, seed=1, popularity_seed=0)
    assert trace.shape == (200, layers, k)
    assert all(len(set(row)) == k for row in trace.reshape(-1, k).tolist())
    result = compare_warmstarts(trace, budget, layers, experts)
    # Index order fills the first third of the layers: its hit rate is the budget share.
    assert result.index_hit == pytest.approx(result.budget_share, abs=0.02)
    assert result.heat_hit > 0.75 and result.heat_hit > 2 * result.index_hit
    # A profile from another run of the same model (other prompts) is nearly as good.
    other = synthetic_trace(200, layers, experts, k, skew=1.2, seed=2, popularity_seed=0)
    cross = compare_warmstarts(trace, budget, layers, experts, plan_from=other)
    assert result.heat_hit >= cross.heat_hit > 0.6
    # Uniform routing: a profile cannot help.
    flat = synthetic_trace(200, layers, experts, k, skew=0.0, seed=1)
    flat_other = synthetic_trace(200, layers, experts, k, skew=0.0, seed=3)
    flat_result = compare_warmstarts(flat, budget, layers, experts, plan_from=flat_other)
    assert abs(flat_result.heat_hit - flat_result.index_hit) < 0.05


def test_trace_heat_accepts_lists_and_arrays():
    trace = synthetic_trace(10, 2, 8, 2, seed=4)
    from_array = trace_heat(trace, 2, 8).counts
    from_lists = trace_heat(trace.tolist(), 2, 8).counts
    assert np.array_equal(from_array, from_lists) and from_array.sum() == 40
    full = compare_warmstarts(trace, 16, 2, 8)
    assert full.index_hit == full.heat_hit == 1.0
