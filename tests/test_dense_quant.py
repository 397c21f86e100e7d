"""`convert --dense-bits`: quantised dense projections, their kernels and the engine on them.

The oracle for the engine is the same engine on an ordinary float32
checkpoint holding the dequantised weights (experts and dense projections):
its float32 path is itself held to transformers by test_engine_oracle.py.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

from tierlab import ASSETS_DIR
from tierlab.engine import quant as Q
from tierlab.engine.container import DENSE_FILE, ContainerExpertSource, convert, read_container_info
from tierlab.engine.errors import ModelError
from tierlab.engine.model import load_engine
from tierlab.engine.qlinear import QuantMatrix, RowStack, qlinear, quantize_matrix

MODEL = ASSETS_DIR / "tiny-moe-8x2"
PROMPT = [5, 77, 300, 12, 9, 401, 33, 2]


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("tokens", [1, 3])
def test_qlinear_matches_float64_reference(bits, tokens):
    rng = np.random.default_rng(bits * 10 + tokens)
    rows, cols = 1101, 192  # an odd row count: a partial last row block
    w = rng.standard_normal((rows, cols)).astype(np.float32)
    m = quantize_matrix(w, bits)
    assert m.shape == (rows, cols) and m.nbytes == m.q.nbytes + m.scales.nbytes
    q, s = Q.quantize(w, bits)
    exact = Q.dequantize(q, s)  # float64
    np.testing.assert_array_equal(m.dequantize(), exact.astype(np.float32))
    x = rng.standard_normal((tokens, cols)).astype(np.float32)
    got = qlinear(m, x[0] if tokens == 1 else x)
    ref = x.astype(np.float64) @ exact.T
    assert np.abs(got.reshape(ref.shape) - ref).max() <= 1e-5 * np.abs(ref).max()


@pytest.fixture(scope="module")
def dense_containers(tmp_path_factory):
    root = tmp_path_factory.mktemp("dq")
    out = {}
    for bits in (8, 4):
        convert(MODEL, root / f"int{bits}", bits=bits, dense_bits=bits)
        out[bits] = root / f"int{bits}"
    return out


def _source_tensors() -> dict[str, np.ndarray]:
    with safe_open(str(MODEL / "model.safetensors"), framework="np") as f:
        import ml_dtypes  # noqa: F401

        return {k: f.get_tensor(k) for k in f.keys()}


@pytest.mark.parametrize("bits", [8, 4])
def test_projections_are_quantised_and_the_rest_is_kept(dense_containers, bits):
    folder = dense_containers[bits]
    assert read_container_info(folder).dense_bits == bits
    source = _source_tensors()
    with safe_open(str(folder / DENSE_FILE), framework="np") as f:
        keys = set(f.keys())
        quantised = {k[: -len(".qweight")] for k in keys if k.endswith(".qweight")}
        # every projection a token multiplies whole, and nothing else
        for name in quantised:
            assert "_proj" in name or name == "lm_head.weight", name
            assert ".mlp.gate.weight" not in name and "shared_expert_gate" not in name
            want = quantize_matrix(source[name].astype(np.float32), bits)
            np.testing.assert_array_equal(f.get_tensor(name + ".qweight"), want.q)
            np.testing.assert_array_equal(f.get_tensor(name + ".qscales"), want.scales)
            assert name not in keys
        assert any("linear_attn.in_proj_qkv" in n for n in quantised)
        assert any("self_attn.o_proj" in n for n in quantised)
        assert any("shared_expert.down_proj" in n for n in quantised)
        assert "lm_head.weight" in quantised or "lm_head.weight" not in source
        # router, embedding and norms are copied bit for bit
        for name in ("model.layers.0.mlp.gate.weight", "model.embed_tokens.weight", "model.norm.weight"):
            np.testing.assert_array_equal(f.get_tensor(name).view(np.uint16), source[name].view(np.uint16))


def _dequantised_checkpoint(container: Path, out: Path) -> Path:
    """A plain float32 checkpoint of what the container's kernels compute with."""
    tensors = {}
    with safe_open(str(container / DENSE_FILE), framework="np") as f:
        keys = set(f.keys())
        for k in keys:
            if k.endswith(".qscales"):
                continue
            if k.endswith(".qweight"):
                name = k[: -len(".qweight")]
                q, s = f.get_tensor(k), f.get_tensor(name + ".qscales")
                m = QuantMatrix(q, s, 8 if q.dtype == np.int8 else 4)
                tensors[name] = m.dequantize()
            else:
                tensors[k] = f.get_tensor(k).astype(np.float32)
    info = read_container_info(container)
    with ContainerExpertSource(container) as src:
        slot = np.empty(src.blob_nbytes, dtype=np.uint8)
        for layer in range(info.n_layers):
            for e in range(info.n_experts):
                src.read(layer, e, slot)
                gate, up, down = Q.blob_matrices(slot, info.bits, info.hidden, info.inter)
                base = f"{info.prefix}layers.{layer}.mlp.experts.{e}."
                for part, w in (("gate", gate), ("up", up), ("down", down)):
                    tensors[base + f"{part}_proj.weight"] = np.ascontiguousarray(w, dtype=np.float32)
    out.mkdir()
    save_file(tensors, str(out / "model.safetensors"))
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        if (container / name).exists():
            shutil.copy(container / name, out / name)
    return out


@pytest.mark.parametrize("bits", [8, 4])
def test_engine_matches_the_dequantised_checkpoint(dense_containers, bits, tmp_path):
    container = dense_containers[bits]
    plain = _dequantised_checkpoint(container, tmp_path / "plain")
    quant_engine = load_engine(container, with_tokenizer=False)
    plain_engine = load_engine(plain, with_tokenizer=False)
    assert type(quant_engine.lm_head) is QuantMatrix and quant_engine.lm_head.bits == bits
    # the bf16 router beside the quantised shared expert: a RowStack, router first
    moe = quant_engine.layers[0].mlp
    assert isinstance(moe.w_in, RowStack) and moe.router_w is moe.w_in.parts[0]
    # prompt logits for every position (the multi-token, block-dequantised path) ...
    got = quant_engine.prefill(PROMPT, all_logits=True)
    ref = plain_engine.prefill(PROMPT, all_logits=True)
    assert np.abs(got - ref).max() <= 1e-4 * np.abs(ref).max()
    # ... then decode steps (the int8/int4 matvecs)
    for token in (17, 250, 3, 99):
        got, ref = quant_engine.step(token), plain_engine.step(token)
        assert np.abs(got - ref).max() <= 1e-4 * np.abs(ref).max()
    quant_engine.close()
    plain_engine.close()


def test_dense_quantised_container_reads_fewer_bytes_per_token(dense_containers):
    from tierlab.app.lab.bench_decode import weight_bytes_per_token

    plain = weight_bytes_per_token(load_engine(MODEL, with_tokenizer=False))
    int4 = weight_bytes_per_token(load_engine(dense_containers[4], with_tokenizer=False))
    # int4 with fp32 scales per 64: 0.5625 of a byte per weight against bf16's 2
    assert int4["lm_head"] == pytest.approx(plain["lm_head"] * 0.5625 / 2, rel=1e-6)
    assert int4["dense"] < 0.45 * plain["dense"]


def test_a_damaged_quantised_tensor_is_a_one_line_error(dense_containers, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(dense_containers[4], bad)
    with safe_open(str(bad / DENSE_FILE), framework="np") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    name = "model.layers.0.self_attn.o_proj.weight" if any("self_attn.o_proj" in k and k.startswith("model.layers.0.")
                                                           for k in tensors) else None
    name = name or next(k[: -len(".qweight")] for k in tensors if k.endswith(".qweight") and "layers.0." in k)
    tensors[name + ".qscales"] = tensors[name + ".qscales"][:, :-1].copy()  # one group too few
    save_file(tensors, str(bad / DENSE_FILE))
    with pytest.raises(ModelError) as err:
        load_engine(bad, with_tokenizer=False)
    message = str(err.value)
    assert "\n" not in message and name in message and DENSE_FILE in message


def test_cli_convert_dense_bits_and_inspect(tmp_path, capsys):
    from tierlab.app.cli.main import main as cli_main

    out = tmp_path / "c"
    assert cli_main(["convert", "--model", str(MODEL), "--out", str(out), "--bits", "4", "--dense-bits", "8"]) == 0
    assert "dense projections int8" in capsys.readouterr().out
    assert json.loads((out / "tierlab_container.json").read_text())["dense_bits"] == 8
    assert cli_main(["inspect", str(out)]) == 0
    assert "projections int8" in capsys.readouterr().out


@pytest.mark.parametrize("huge_from", [0, None])
def test_bytes_per_token_count_every_dense_matrix_once(huge_from, monkeypatch):
    """bench decode's roofline divides by these bytes: every 2-D dense tensor of the checkpoint
    (projections, router, shared expert), the DeltaNet convolutions (held as float32) and one
    embedding row, each counted once (the router view of the fused matrix is not counted again)."""
    from tierlab.engine import hugepages
    from tierlab.app.lab.bench_decode import weight_bytes_per_token

    if huge_from is not None:  # every weight on a mapping, as a real model's large ones are
        monkeypatch.setattr(hugepages, "MIN_HUGE_BYTES", huge_from)
    source = _source_tensors()
    engine = load_engine(MODEL, with_tokenizer=False)
    expected = engine.embed.nbytes // engine.config.vocab_size
    for name, t in source.items():
        if ".mlp.experts." in name or name.endswith(("embed_tokens.weight", "lm_head.weight")):
            continue
        if name.endswith("conv1d.weight"):
            expected += t.size * 4
        elif t.ndim == 2:
            expected += t.nbytes
    got = weight_bytes_per_token(engine)
    assert got["dense"] == expected
    assert got["lm_head"] == engine.lm_head.nbytes
