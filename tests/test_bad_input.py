"""Bad checkpoints and templates: one line naming the file and the problem, exit 2, no traceback."""

from __future__ import annotations

import json
import shutil
import struct

import pytest

from conftest import run_cli


@pytest.fixture()
def model_copy(oracle_models, tmp_path):
    src = oracle_models["qwen3_moe"][1]
    dst = tmp_path / "model"
    shutil.copytree(src, dst)
    return dst


def assert_one_line_error(proc, *needles: str) -> None:
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


def run_ref(folder, *extra):
    return run_cli("ref", "--model", str(folder), "--prompt-ids", "3,4,5", "-n", "2", "-o", str(folder / "r.json"), *extra)


def test_truncated_safetensors(model_copy):
    f = model_copy / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    assert_one_line_error(run_ref(model_copy), "model.safetensors", "truncated")


def test_header_offsets_past_end(model_copy):
    f = model_copy / "model.safetensors"
    data = bytearray(f.read_bytes())
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    name = next(k for k in header if k != "__metadata__")
    begin, end = header[name]["data_offsets"]
    size = len(data) - 8 - n
    header[name]["data_offsets"] = [size, size + (end - begin)]
    blob = json.dumps(header).encode()
    blob += b" " * ((8 - len(blob) % 8) % 8)
    f.write_bytes(struct.pack("<Q", len(blob)) + blob + bytes(data[8 + n:]))
    assert_one_line_error(run_ref(model_copy), "model.safetensors", name)


def test_missing_tensor(model_copy):
    from safetensors.numpy import load_file, save_file

    f = model_copy / "model.safetensors"
    tensors = load_file(str(f))
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, str(f))
    assert_one_line_error(run_ref(model_copy), "missing tensor model.layers.1.self_attn.k_proj.weight")


def test_shape_disagrees_with_config(model_copy):
    cfg = json.loads((model_copy / "config.json").read_text())
    cfg["moe_intermediate_size"] = 48
    (model_copy / "config.json").write_text(json.dumps(cfg))
    assert_one_line_error(run_ref(model_copy), "model.safetensors", "shape", "config.json")


def test_unknown_model_type(model_copy):
    cfg = json.loads((model_copy / "config.json").read_text())
    cfg["model_type"] = "llama"
    (model_copy / "config.json").write_text(json.dumps(cfg))
    assert_one_line_error(run_ref(model_copy), "config.json", "unknown model_type 'llama'")


def test_not_a_model_folder(tmp_path):
    assert_one_line_error(run_ref(tmp_path), "config.json")


def _with_tokenizer(folder, template: str):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {chr(97 + i): i for i in range(26)}
    vocab["<|im_end|>"] = 26
    tok = Tokenizer(models.WordLevel(vocab, unk_token="a"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": template, "eos_token": "<|im_end|>"}))


def test_chat_template_reaching_python_internals(model_copy):
    evil = "{{ ''.__class__.__mro__[1].__subclasses__() }}{% for m in messages %}{{ m.content }}{% endfor %}"
    _with_tokenizer(model_copy, evil)
    proc = run_cli("generate", "--model", str(model_copy), "--prompt", "abc", "--chat", "-n", "2")
    assert_one_line_error(proc, "tokenizer_config.json", "sandbox")


def test_chat_template_renders_in_sandbox(model_copy):
    ok = "{% for m in messages %}{{ m.role }}:{{ m.content }}{% endfor %}{% if add_generation_prompt %}z{% endif %}"
    _with_tokenizer(model_copy, ok)
    proc = run_cli("generate", "--model", str(model_copy), "--prompt", "abc", "--chat", "-n", "2", "--json")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert len(data["prompt_ids"]) == len("user:abcz")


def test_bad_reference_file(model_copy, tmp_path):
    bad = tmp_path / "ref.json"
    bad.write_text("[1, 2")
    proc = run_cli("eval", "--model", str(model_copy), "--ref", str(bad))
    assert_one_line_error(proc, "ref.json", "not a reference file")


def test_bad_knob_value(model_copy, tmp_path):
    ref = tmp_path / "ref.json"
    ref.write_text(json.dumps({"prompt_ids": [3, 4], "full_ids": [3, 4, 5]}))
    proc = run_cli("eval", "--model", str(model_copy), "--ref", str(ref), env={"ROUTE_J": "many"})
    assert_one_line_error(proc, "ROUTE_J", "'many'")
