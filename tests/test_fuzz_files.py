"""Fuzzing the files a run reads besides the checkpoint: heat profiles, session logs, references
and a container's manifest. Each corrupted file is accepted (when it is still valid) or refused
in one line with exit 2; never a traceback, never an output written."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from fuzzing import FUZZ, MODEL, assert_clean, assert_refused, json_dump, json_values, run
from tierlab.engine.heat import MAGIC

LAYERS, EXPERTS = 8, 32  # the shipped tiny-moe


# --- heat profiles ---------------------------------------------------------------------------------


def heat_is_valid(data: bytes) -> bool:
    """The format's own rule, stated independently of the reader."""
    if len(data) < 12:
        return False
    magic, layers, experts = struct.unpack("<3I", data[:12])
    return magic == MAGIC and layers > 0 and experts > 0 and len(data) == 12 + 4 * layers * experts


heat_bytes = st.one_of(
    st.binary(max_size=64),
    st.builds(lambda layers, experts, extra, body: struct.pack("<3I", MAGIC, layers, experts) + body[: extra],
              st.integers(0, 2**32 - 1), st.integers(0, 2**32 - 1), st.integers(0, 256), st.binary(min_size=256, max_size=256)),
    st.builds(lambda layers, experts, cut: (struct.pack("<3I", MAGIC, layers, experts)
                                            + bytes(4 * layers * experts))[: max(0, 12 + 4 * layers * experts + cut)],
              st.integers(1, 6), st.integers(1, 6), st.integers(-8, 8)),
)


@FUZZ
@given(data=heat_bytes)
def test_a_heat_profile_is_read_only_when_the_format_allows(capsys, tmp_path_factory, data):
    path = tmp_path_factory.mktemp("heat") / "x.heat"
    path.write_bytes(data)
    code, out, err = run(capsys, "heat", "show", path)
    if heat_is_valid(data):
        assert code == 0 and not err, err
    else:
        assert_refused(code, err, str(path))


@FUZZ
@given(layers=st.integers(1, 12), experts=st.integers(1, 40))
def test_a_heat_profile_of_other_dims_is_refused_for_the_model(capsys, tmp_path_factory, layers, experts):
    path = tmp_path_factory.mktemp("heat") / "dims.heat"
    path.write_bytes(struct.pack("<3I", MAGIC, layers, experts) + bytes(4 * layers * experts))
    code, _, err = run(capsys, "heat", "show", path, "--model", MODEL)
    if (layers, experts) == (LAYERS, EXPERTS):
        assert code == 0, err
    else:
        assert_refused(code, err, str(path), f"{layers} layers x {experts} experts")


# --- session logs ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def real_log(tmp_path_factory) -> list[dict]:
    """The records of a real `generate --log` run on the shipped model."""
    from tierlab.app.cli.main import main as cli_main

    path = tmp_path_factory.mktemp("log") / "run.jsonl"
    assert cli_main(["generate", "--model", str(MODEL), "--prompt", "Hello", "-n", "5", "--log", str(path)]) == 0
    return [json.loads(line) for line in path.read_text().splitlines()]


def write_log(path: Path, records: list) -> None:
    path.write_text("".join(json_dump(r) + "\n" for r in records))


def token_positions(records: list[dict]) -> list[int]:
    return [i for i, r in enumerate(records) if r["type"] == "token"]


@FUZZ
@given(data=st.data(), field=st.sampled_from(["chosen", "true_topk"]),
       bad=st.one_of(st.integers(max_value=-2), st.integers(min_value=EXPERTS, max_value=10**30),
                     st.floats(allow_nan=True), st.text(max_size=4), st.booleans(), st.none()))
def test_compare_refuses_expert_ids_outside_the_model(capsys, tmp_path_factory, real_log, data, field, bad):
    records = json.loads(json.dumps(real_log))
    token = records[data.draw(st.sampled_from(token_positions(records)))]
    layer = data.draw(st.sampled_from(token["layers"]))
    layer[field][data.draw(st.integers(0, len(layer[field]) - 1))] = bad
    path = tmp_path_factory.mktemp("log") / "bad.jsonl"
    write_log(path, records)
    code, out, err = run(capsys, "compare", path)
    assert_refused(code, err, str(path))
    assert not out


@FUZZ
@given(key=st.sampled_from(["tf_nll", "route_kl"]),
       value=st.one_of(st.text(max_size=6), st.booleans(), st.lists(st.integers(), max_size=2),
                       st.dictionaries(st.text(max_size=2), st.integers(), max_size=1),
                       st.sampled_from([float("nan"), float("inf"), float("-inf")])))
def test_compare_refuses_a_summary_figure_that_is_not_a_number(capsys, tmp_path_factory, real_log, key, value):
    records = json.loads(json.dumps(real_log))
    summary = next(r for r in records if r["type"] == "summary")
    summary[key] = value
    path = tmp_path_factory.mktemp("log") / "summary.jsonl"
    write_log(path, records)
    code, out, err = run(capsys, "compare", path)
    assert_refused(code, err, str(path), key)


@FUZZ
@given(data=st.data(), junk=st.one_of(json_values.map(json_dump), st.binary(max_size=40).map(lambda b: b.decode("latin-1"))))
def test_compare_on_a_log_with_any_line_replaced_is_clean(capsys, tmp_path_factory, real_log, data, junk):
    lines = [json_dump(r) for r in real_log]
    lines[data.draw(st.integers(0, len(lines) - 1))] = junk.replace("\n", " ")
    path = tmp_path_factory.mktemp("log") / "junk.jsonl"
    path.write_text("\n".join(lines) + "\n")
    code, _, err = run(capsys, "compare", path)
    assert_clean(code, err)


def test_a_log_line_past_the_limit_is_damage_read_in_bounded_pieces(capsys, tmp_path, real_log):
    lines = [json_dump(r) for r in real_log]
    lines.insert(2, '{"type": "token", "pad": "' + "x" * (3 << 20) + '"}')
    path = tmp_path / "long.jsonl"
    path.write_text("\n".join(lines) + "\n")
    code, _, err = run(capsys, "compare", path)
    assert code == 0 and "line 3 is longer than 1048576 bytes" in err, err


# --- references ---------------------------------------------------------------------------------------


#: ids no model has (ids inside 0..2**31 but past this model's vocabulary are refused once the model is open:
#: tests/test_validation.py)
bad_ids = st.one_of(st.sampled_from([1e300, -1, "x", 2.5, True, None, 10**30, [1], {"a": 1}]),
                    st.integers(min_value=2**31), st.integers(max_value=-1), st.floats(), st.text(max_size=3))


@FUZZ
@given(data=st.data(), bad=bad_ids, where=st.sampled_from(["prompt_ids", "full_ids"]))
def test_a_reference_with_an_id_that_is_no_token_is_refused_before_the_run(capsys, tmp_path_factory, data, bad, where):
    folder = tmp_path_factory.mktemp("ref")
    ref = json.loads((MODEL / "ref.json").read_text())
    ids = ref[where]
    pos = data.draw(st.integers(0, len(ids) - 1))
    ids[pos] = bad
    if where == "prompt_ids" and pos < len(ref["full_ids"]):
        ref["full_ids"][pos] = bad
    path = folder / "ref.json"
    path.write_text(json_dump(ref))
    log = folder / "run.jsonl"
    code, out, err = run(capsys, "eval", "--model", MODEL, "--ref", path, "--log", log)
    assert_refused(code, err, str(path))
    assert not log.exists() and not out


@FUZZ
@given(value=json_values)
def test_any_reference_json_is_refused_cleanly(capsys, tmp_path_factory, value):
    path = tmp_path_factory.mktemp("ref") / "ref.json"
    path.write_text(json_dump(value))
    code, _, err = run(capsys, "eval", "--model", MODEL, "--ref", path)
    assert_refused(code, err, str(path))


# --- a container's manifest ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def container(tmp_path_factory) -> Path:
    from tierlab.app.cli.main import main as cli_main

    out = tmp_path_factory.mktemp("container") / "c"
    assert cli_main(["convert", "--model", str(MODEL), "--out", str(out), "--bits", "4", "--dense-bits", "8"]) == 0
    return out


@FUZZ
@given(field=st.sampled_from(["format", "version", "bits", "group", "n_layers", "n_experts", "hidden", "inter",
                              "blob_nbytes", "blob_stride", "layer_offsets", "dense_bits"]),
       value=json_values)
def test_a_corrupted_container_manifest_is_refused_cleanly(capsys, container, field, value):
    manifest = container / "tierlab_container.json"
    original = manifest.read_text()
    try:
        raw = json.loads(original)
        changed = raw.get(field) != value
        raw[field] = value
        manifest.write_text(json_dump(raw))
        code, _, err = run(capsys, "inspect", container)
        assert_clean(code, err)
        if changed and field in ("format", "version") or (field == "layer_offsets" and not isinstance(value, list)):
            assert_refused(code, err, "tierlab_container.json")
    finally:
        manifest.write_text(original)


def test_a_container_dense_file_with_non_finite_scales_is_refused_at_load(capsys, container, tmp_path):
    import shutil

    from fuzzing import header_of

    copy = tmp_path / "c"
    shutil.copytree(container, copy)
    dense = copy / "dense.safetensors"
    header, body = header_of(dense)
    name = next(k for k in sorted(header) if k.endswith(".qscales"))
    begin = header[name]["data_offsets"][0]
    data = bytearray(dense.read_bytes())
    start = len(data) - len(body) + begin
    data[start:start + 4] = np.float32(np.inf).tobytes()
    dense.write_bytes(bytes(data))
    out = tmp_path / "r.json"
    code, _, err = run(capsys, "ref", "--model", copy, "--prompt-ids", "1,2,3", "-n", "2", "-o", out)
    assert_refused(code, err, "dense.safetensors", name, "NaN/Inf")
    assert not out.exists()
