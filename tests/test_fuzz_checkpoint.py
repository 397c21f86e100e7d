"""Fuzzing checkpoints: corrupted safetensors headers and config.json values are refused in one
line with exit 2 (`tierlab inspect` reads the config and every header as a load does)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fuzzing import FUZZ, MODEL, assert_clean, assert_refused, header_of, json_dump, json_values, model_folder, run, \
    write_safetensors
from tierlab.engine.config import DIM_CAPS

HEADER, _DATA = header_of(MODEL / "model.safetensors")
BODY = len(_DATA)  # the header checks need the data's length, not its bytes
NAMES = sorted(k for k in HEADER if k != "__metadata__")
ELEM = {"F32": 4, "BF16": 2, "F16": 2, "F64": 8, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}


@pytest.fixture(scope="module")
def weighted(tmp_path_factory) -> Path:
    """A model folder whose config.json each case rewrites (the weights stay as shipped)."""
    return model_folder(tmp_path_factory.mktemp("fuzz") / "weighted")


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return model_folder(tmp_path_factory.mktemp("fuzz") / "model", weights=False)


def inspect_with(capsys, folder: Path, header_text: bytes, body: bytes = BODY, length: int | None = None):
    write_safetensors(folder / "model.safetensors", header_text, body, length)
    return run(capsys, "inspect", folder)


def entry_breaks(name: str, entry) -> bool:
    """Whether a replaced header entry is certainly invalid for this file (not merely different)."""
    if not isinstance(entry, dict) or set(entry) < {"dtype", "shape", "data_offsets"}:
        return True
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in ELEM:
        return True
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        return True
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(type(v) is int and v >= 0 for v in offsets):
        return True
    numel = 1
    for d in shape:
        numel *= d
    begin, end = offsets
    return end - begin != numel * ELEM[dtype] or end > BODY or begin > end


@FUZZ
@given(index=st.integers(0, len(NAMES) - 1), field=st.sampled_from(["dtype", "shape", "data_offsets"]),
       value=json_values)
def test_a_corrupted_header_field_is_refused(capsys, folder, index, field, value):
    name = NAMES[index]
    header = json.loads(json.dumps(HEADER))
    header[name][field] = value
    code, _, err = inspect_with(capsys, folder, json_dump(header).encode())
    if entry_breaks(name, header[name]):
        assert_refused(code, err, "model.safetensors")
    else:  # a shape of the same byte count is the config's to refuse, at load
        assert_clean(code, err)


@FUZZ
@given(index=st.integers(0, len(NAMES) - 1), other=st.integers(0, len(NAMES) - 1), shift=st.integers(-64, 64))
def test_overlapping_byte_ranges_are_refused(capsys, folder, index, other, shift):
    a, b = NAMES[index], NAMES[other]
    if a == b:
        other = (other + 1) % len(NAMES)
        b = NAMES[other]
    header = json.loads(json.dumps(HEADER))
    a_begin, a_end = header[a]["data_offsets"]
    b_begin, b_end = header[b]["data_offsets"]
    start = max(0, min(a_begin + shift, BODY - (b_end - b_begin)))
    if not (start < a_end and a_begin < start + (b_end - b_begin)):
        start = a_begin  # make sure the two ranges share bytes
    header[b]["data_offsets"] = [start, start + (b_end - b_begin)]
    code, _, err = inspect_with(capsys, folder, json_dump(header).encode())
    assert_refused(code, err, "model.safetensors", "overlap")


@FUZZ
@given(index=st.integers(0, len(NAMES) - 1))
def test_a_name_defined_twice_is_refused(capsys, folder, index):
    name = NAMES[index]
    text = json.dumps(HEADER)
    entry = json.dumps({name: HEADER[name]})[1:-1]
    code, _, err = inspect_with(capsys, folder, ("{" + entry + "," + text[1:]).encode())
    assert_refused(code, err, "model.safetensors", "twice")


@FUZZ
@given(depth=st.integers(1, 200_000), opener=st.sampled_from(["[", "{\"a\":", "[{\"x\":"]))
def test_deeply_nested_headers_are_refused(capsys, folder, depth, opener):
    code, _, err = inspect_with(capsys, folder, (opener * depth).encode())
    assert_refused(code, err, "model.safetensors")


@FUZZ
@given(length=st.integers(0, 2**64 - 1), data=st.binary(max_size=64))
def test_a_random_header_length_or_bytes_are_refused(capsys, folder, length, data):
    real = json.dumps(HEADER).encode()
    if length % 2:
        code, _, err = inspect_with(capsys, folder, real, length=length if length != len(real) + (-len(real) % 8)
                                    else length + 1)
    else:
        code, _, err = inspect_with(capsys, folder, data, body=0)
    assert_refused(code, err, "model.safetensors")


CONFIG = json.loads((MODEL / "config.json").read_text())
INT_FIELDS = sorted(k for k in CONFIG if k in DIM_CAPS) + ["num_experts"]
BAD_INTS = st.one_of(st.integers(max_value=-1), st.integers(min_value=2**26 + 1), st.sampled_from([10**400, 10**9]),
                     st.floats(allow_nan=True, allow_infinity=True).filter(lambda v: v != int(v) if v == v and abs(v) != float("inf") else True),
                     st.text(max_size=8), st.booleans(), st.lists(st.integers(), max_size=3), st.dictionaries(st.text(max_size=3), st.integers(), max_size=2))


@FUZZ
@given(field=st.sampled_from(sorted(CONFIG)), value=json_values)
def test_any_config_value_is_accepted_or_refused_cleanly(capsys, weighted, field, value):
    (weighted / "config.json").write_text(json_dump(dict(CONFIG, **{field: value})))
    code, _, err = run(capsys, "inspect", weighted)
    assert_clean(code, err)


@FUZZ
@given(field=st.sampled_from(INT_FIELDS), value=BAD_INTS)
def test_a_size_of_the_wrong_type_or_beyond_its_cap_is_refused(capsys, weighted, field, value):
    (weighted / "config.json").write_text(json_dump(dict(CONFIG, **{field: value})))
    code, _, err = run(capsys, "inspect", weighted)
    assert_refused(code, err, "config.json")
