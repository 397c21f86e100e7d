"""Strict validation at the edge (issue 17 items 2 and 3): non-finite weights, files that are not
regular files or are too large, shards that disagree, prompts past the context, the app's own
error paths and SIGTERM. Each bad input is one line, exit 2, nothing written."""

from __future__ import annotations

import errno
import json
import os
import struct
from pathlib import Path

import pytest

from conftest import run_cli
from fuzzing import MODEL, assert_refused, header_of, model_folder, run
from tierlab.engine.safetensors_file import TensorSpec, read_header, read_tensor, write_file

BF16_NAN, BF16_INF = b"\xc0\x7f", b"\x80\x7f"


def poke(folder: Path, names: list[str], value: bytes, file: str = "model.safetensors") -> None:
    """Overwrite the first element of each named tensor with `value` (its raw bytes)."""
    path = folder / file
    header, body = header_of(path)
    data = bytearray(path.read_bytes())
    start = len(data) - len(body)
    for name in names:
        begin = header[name]["data_offsets"][0]
        data[start + begin:start + begin + len(value)] = value
    path.write_bytes(bytes(data))


def ref_args(folder: Path, out: Path, *extra: str) -> list:
    return ["ref", "--model", folder, "--prompt-ids", "1,2,3", "-n", "2", "-o", out, *extra]


ALL_EXPERTS_OF_LAYER_0 = [f"model.layers.0.mlp.experts.{e}.gate_proj.weight" for e in range(32)]


@pytest.mark.parametrize("names, value", [
    (["model.embed_tokens.weight"], BF16_NAN),
    (["model.layers.0.mlp.gate.weight"], BF16_INF),
    (["model.layers.3.input_layernorm.weight"], BF16_NAN),
    (["model.layers.0.linear_attn.in_proj_qkv.weight"], BF16_INF),
    (["lm_head.weight"], BF16_NAN),
    (ALL_EXPERTS_OF_LAYER_0, BF16_NAN),  # the experts: checked on each one's first read
], ids=["embedding", "router", "norm", "dense", "lm_head", "experts"])
def test_non_finite_weights_are_refused_naming_the_tensor(capsys, tmp_path, names, value):
    folder = model_folder(tmp_path / "m")
    poke(folder, names, value)
    out = tmp_path / "r.json"
    line = assert_refused(*run(capsys, *ref_args(folder, out))[::2], "model.safetensors", "NaN/Inf")
    assert any(name in line for name in names), line
    assert not out.exists()


def test_convert_refuses_non_finite_expert_and_dense_weights(capsys, tmp_path):
    for names, what in ((["model.layers.5.mlp.experts.7.down_proj.weight"], "layer 5 expert 7"),
                        (["model.layers.2.linear_attn.out_proj.weight"], "out_proj")):
        folder = model_folder(tmp_path / what.replace(" ", "_"))
        poke(folder, names, BF16_INF)
        out = tmp_path / f"c-{len(what)}"
        code, _, err = run(capsys, "convert", "--model", folder, "--out", out, "--dense-bits", "8")
        assert_refused(code, err, "NaN/Inf", what)
        assert not out.exists() and not out.with_name(out.name + ".partial").exists()


def test_convert_on_a_full_disk_is_one_line_and_leaves_nothing(capsys, tmp_path, monkeypatch):
    import builtins

    from tierlab.engine import container

    real_open = builtins.open

    class Full:
        def __init__(self, f):
            self.f, self.left = f, 3

        def write(self, data):
            if self.left == 0:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            self.left -= 1
            return self.f.write(data)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def __getattr__(self, name):
            return getattr(self.f, name)

    monkeypatch.setattr(container, "open", lambda *a, **k: Full(real_open(*a, **k)), raising=False)
    out = tmp_path / "c"
    code, _, err = run(capsys, "convert", "--model", MODEL, "--out", out)
    monkeypatch.undo()
    assert_refused(code, err, "No space left")
    assert list(tmp_path.iterdir()) == []


# --- only regular files, of a plausible size ----------------------------------------------------------


@pytest.fixture()
def fifo(tmp_path) -> Path:
    path = tmp_path / "pipe"
    os.mkfifo(path)
    return path


def special(kind: str, tmp_path: Path, fifo: Path) -> Path:
    if kind == "fifo":
        return fifo
    if kind == "dir":
        (tmp_path / "adir").mkdir()
        return tmp_path / "adir"
    return Path("/dev/zero")


@pytest.mark.parametrize("kind", ["fifo", "dir", "zero"])
@pytest.mark.parametrize("what", ["config.json", "tokenizer.json", "model.safetensors"])
def test_a_model_file_that_is_not_a_regular_file_is_refused_without_blocking(capsys, tmp_path, fifo, kind, what):
    folder = model_folder(tmp_path / "m")
    (folder / what).unlink()
    (folder / what).symlink_to(special(kind, tmp_path, fifo))
    code, _, err = run(capsys, "generate", "--model", folder, "--prompt", "Hi", "-n", "1")
    assert_refused(code, err, what, "not a regular file")


@pytest.mark.parametrize("kind", ["fifo", "dir", "zero"])
@pytest.mark.parametrize("command", ["heat", "compare", "eval"])
def test_a_heat_log_or_reference_that_is_not_a_regular_file_is_refused(capsys, tmp_path, fifo, kind, command):
    path = special(kind, tmp_path, fifo)
    argv = {"heat": ["heat", "show", path], "compare": ["compare", path],
            "eval": ["eval", "--model", MODEL, "--ref", path]}[command]
    code, _, err = run(capsys, *argv)
    assert_refused(code, err, str(path), "not a regular file")


def test_heat_file_naming_a_fifo_is_refused_in_a_subprocess_without_hanging(tmp_path, fifo):
    proc = run_cli("generate", "--model", str(MODEL), "--prompt", "Hi", "-n", "1",
                   env={"HEAT_FILE": str(fifo)}, timeout=120)
    lines = [line for line in proc.stderr.splitlines() if "error" in line]
    assert proc.returncode == 2 and len(lines) == 1 and "not a regular file" in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("what, size", [("config.json", 4 << 20), ("tokenizer_config.json", 64 << 20)])
def test_a_file_larger_than_its_kind_holds_is_refused_before_reading(capsys, tmp_path, what, size):
    folder = model_folder(tmp_path / "m")
    with open(folder / what, "r+b") as f:
        f.truncate(size + 1)  # a hole: nothing is written, nothing would be read
    code, _, err = run(capsys, "generate", "--model", folder, "--prompt", "Hi", "-n", "1")
    assert_refused(code, err, what, f"more than the {size}")


def test_a_heat_profile_must_be_exactly_the_size_its_dims_give(capsys, tmp_path):
    path = tmp_path / "big.heat"
    with open(path, "wb") as f:
        f.write(struct.pack("<3I", 0x51544831, 8, 32))
        f.truncate(12 + 4 * 8 * 32 + (200 << 20))  # 200 MiB of trailing bytes (a hole)
    assert_refused(*run(capsys, "heat", "show", path)[::2], "trailing bytes", "8x32 needs 1036 bytes")


# --- shards and the index --------------------------------------------------------------------------


def split_in_two(folder: Path, index_names=None, duplicate: str | None = None) -> None:
    """Rewrite the checkpoint as two shards and an index (optionally one tensor in both shards)."""
    infos = read_header(folder / "model.safetensors")
    names = sorted(infos)
    halves = {"a.safetensors": names[: len(names) // 2], "b.safetensors": names[len(names) // 2:]}
    if duplicate:
        halves["b.safetensors"] = halves["b.safetensors"] + [duplicate]
    arrays = {n: read_tensor(infos[n]) for n in names}
    for file, part in halves.items():
        specs = [TensorSpec(n, infos[n].dtype, infos[n].shape) for n in part]
        write_file(folder / file, specs, (arrays[n] for n in part))
    (folder / "model.safetensors").unlink()
    weight_map = {n: f for f, part in halves.items() for n in part}
    weight_map.update(index_names or {})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


def test_shards_that_agree_load_and_generate_the_same_ids(capsys, tmp_path):
    folder = model_folder(tmp_path / "m")
    split_in_two(folder)
    out = tmp_path / "r.json"
    assert run(capsys, *ref_args(folder, out))[0] == 0
    shipped = tmp_path / "s.json"
    assert run(capsys, *ref_args(MODEL, shipped))[0] == 0
    assert json.loads(out.read_text()) == json.loads(shipped.read_text())


def test_a_tensor_defined_in_two_shards_is_refused(capsys, tmp_path):
    folder = model_folder(tmp_path / "m")
    split_in_two(folder, duplicate="model.embed_tokens.weight")
    assert_refused(*run(capsys, "inspect", folder)[::2], "model.embed_tokens.weight", "both a.safetensors and b.safetensors")


def test_an_index_naming_the_wrong_shard_is_refused(capsys, tmp_path):
    folder = model_folder(tmp_path / "m")
    split_in_two(folder, index_names={"model.norm.weight": "a.safetensors"})
    assert_refused(*run(capsys, "inspect", folder)[::2], "index.json", "model.norm.weight", "defined in b.safetensors")


def test_a_config_with_fewer_layers_than_the_checkpoint_is_refused(capsys, tmp_path):
    folder = model_folder(tmp_path / "m")
    config = json.loads((folder / "config.json").read_text())
    config["num_hidden_layers"] = 6
    config["layer_types"] = config["layer_types"][:6]
    (folder / "config.json").write_text(json.dumps(config))
    assert_refused(*run(capsys, "inspect", folder)[::2], "layers 0..7", "num_hidden_layers=6")


# --- the context --------------------------------------------------------------------------------------


@pytest.fixture()
def short_context(tmp_path) -> Path:
    folder = model_folder(tmp_path / "short")
    config = json.loads((folder / "config.json").read_text())
    config["max_position_embeddings"] = 12
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_a_prompt_longer_than_the_context_is_refused_before_prefill(capsys, short_context, tmp_path):
    code, out, err = run(capsys, "generate", "--model", short_context, "--prompt", "word " * 40, "-n", "2")
    assert_refused(code, err, "the prompt has", "context (12 tokens")
    out_file = tmp_path / "r.json"
    code, _, err = run(capsys, "ref", "--model", short_context, "--prompt-ids", ",".join(["5"] * 13), "-n", "1",
                       "-o", out_file)
    assert_refused(code, err, "context (12")
    assert not out_file.exists()


def test_generation_past_the_context_stops_at_it(capsys, short_context):
    """max new tokens is an upper bound: prompt + generated never exceed the context."""
    code, out, err = run(capsys, "generate", "--model", short_context, "--prompt", "Hello", "-n", "50")
    assert code == 0, err
    from tierlab.engine.model import load_engine

    engine = load_engine(short_context, with_tokenizer=False, warmup=False)
    try:
        new = list(engine.generate([1, 2, 3, 4, 5], 50, eos_ids=[]))
        assert len(new) == 12 - 5 and engine.pos == 12
    finally:
        engine.close()


def test_a_fixed_count_past_the_context_is_refused(capsys, short_context, tmp_path):
    out_file = tmp_path / "r.json"
    code, _, err = run(capsys, "ref", "--model", short_context, "--prompt-ids", "1,2,3", "-n", "20", "-o", out_file)
    assert_refused(code, err, "3 prompt + 20 new tokens", "context (12")
    assert not out_file.exists()
    ref = tmp_path / "long.json"
    ref.write_text(json.dumps({"prompt_ids": [1, 2], "full_ids": [1, 2] + [3] * 20}))
    log = tmp_path / "run.jsonl"
    assert_refused(*run(capsys, "eval", "--model", short_context, "--ref", ref, "--log", log)[::2],
                   str(ref), "21 positions")
    assert not log.exists()


def test_a_reference_id_past_the_vocabulary_is_refused_naming_the_file(capsys, tmp_path):
    ref = tmp_path / "ref.json"
    ref.write_text(json.dumps({"prompt_ids": [1, 2], "full_ids": [1, 2, 6000]}))
    log = tmp_path / "run.jsonl"
    assert_refused(*run(capsys, "eval", "--model", MODEL, "--ref", ref, "--log", log)[::2],
                   str(ref), "token id 6000", "0..5999")
    assert not log.exists()


def test_a_200_mb_log_line_stops_reading_at_the_limit(tmp_path, capsys):
    import tracemalloc

    from tierlab.engine.sessionlog import SessionLogWarning, read_session_log

    good = tmp_path / "good.jsonl"
    assert run(capsys, "generate", "--model", MODEL, "--prompt", "Hi", "-n", "2", "--log", good)[0] == 0
    path = tmp_path / "long.jsonl"
    header = good.read_text().splitlines()[0] + "\n"
    with open(path, "wb") as f:
        f.write(header.encode())
        f.truncate(len(header) + (200 << 20))  # one 200 MB line (a hole of zeros, no newline)
    tracemalloc.start()
    with pytest.warns(SessionLogWarning, match="line 2 is longer than 1048576 bytes"):
        log = read_session_log(path)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert log.tokens == [] and peak < 16 << 20, peak
