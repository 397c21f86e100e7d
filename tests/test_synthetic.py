"""make-synthetic's streamed writers: deterministic, the same weights in both formats, loadable by
transformers, finite over 40 layers, and bounded in memory."""

from __future__ import annotations

import hashlib
import json
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from conftest import run_cli
from tierlab.engine.container import DENSE_FILE, EXPERTS_BIN, convert, read_container_info
from tierlab.engine.safetensors_file import read_header, read_tensor
from tierlab.engine.synthetic import (
    INDEX_FILE, config_json, dense_tensors, expert_tensors, real_shape, values, write_container, write_hf_folder,
)

# 4 layers x 256 experts at reduced widths: the real expert count, a few MB per layer
SMALL = dict(hidden=128, moe_inter=64, vocab=512, n_heads=4, n_kv_heads=2, head_dim=64, lin_k_heads=4,
             lin_v_heads=8, lin_k_dim=32, lin_v_dim=32, shared_inter=64)


def small(arch: str = "qwen3_5_moe", layers: int = 4, experts: int = 256, **over):
    sizes = dict(SMALL) if arch == "qwen3_5_moe" else dict(hidden=128, moe_inter=64, vocab=512, n_heads=4,
                                                          n_kv_heads=2, head_dim=32)
    sizes.update(over)
    vocab = sizes.pop("vocab")
    return real_shape(arch, layers, experts, top_k=8 if experts >= 8 else experts, vocab=vocab, **sizes)


def folder_digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def tensors_of(path: Path) -> dict[str, np.ndarray]:
    return {name: read_tensor(info) for name, info in read_header(path).items()}


@pytest.fixture(scope="module")
def hf_small(tmp_path_factory):
    out = tmp_path_factory.mktemp("hf")
    write_hf_folder(small(), 3, out, shard_bytes=4 << 20)  # several shards and an index
    return out


def test_same_seed_same_files_other_seed_other_weights(hf_small, tmp_path):
    again, other = tmp_path / "again", tmp_path / "other"
    again.mkdir(), other.mkdir()
    write_hf_folder(small(), 3, again, shard_bytes=4 << 20)
    write_hf_folder(small(), 4, other, shard_bytes=4 << 20)
    assert folder_digest(again) == folder_digest(hf_small)
    assert (hf_small / INDEX_FILE).is_file() and len(list(hf_small.glob("model-*.safetensors"))) > 1
    name = "model.layers.1.mlp.experts.200.down_proj.weight"
    index = json.loads((hf_small / INDEX_FILE).read_text())["weight_map"]
    ours = tensors_of(hf_small / index[name])[name]
    theirs = tensors_of(other / json.loads((other / INDEX_FILE).read_text())["weight_map"][name])[name]
    assert ours.shape == (128, 64) and not np.array_equal(ours, theirs)


def test_a_tensor_does_not_depend_on_what_else_is_written():
    """Each tensor has its own generator: a wider model shares the narrower one's experts."""
    a, b = small(experts=16), small(experts=32, layers=6)
    for t_a, t_b in zip(expert_tensors(a, 2, 7), expert_tensors(b, 2, 7)):
        np.testing.assert_array_equal(values(5, t_a), values(5, t_b))


def test_weights_are_scaled_like_a_trained_model(hf_small):
    import ml_dtypes

    index = json.loads((hf_small / INDEX_FILE).read_text())["weight_map"]
    def get(name):
        return tensors_of(hf_small / index[name])[name].view(ml_dtypes.bfloat16).astype(np.float32)

    w = get("model.layers.0.mlp.experts.0.gate_proj.weight")
    assert abs(float(w.std()) - 0.02) < 0.001 and abs(float(w.mean())) < 0.001
    assert np.all(get("model.layers.0.input_layernorm.weight") == 0)  # Qwen3.5 scales by 1 + w
    assert np.all(get("model.layers.0.linear_attn.norm.weight") == 1)


@pytest.mark.parametrize("bits,dense_bits", [(4, 0), (8, 4)])
def test_container_written_directly_equals_convert_of_the_folder(hf_small, tmp_path, bits, dense_bits):
    direct = tmp_path / "direct"
    direct.mkdir()
    write_container(small(), 3, direct, bits, dense_bits)
    converted = convert(hf_small, tmp_path / "converted", bits=bits, dense_bits=dense_bits)
    assert (direct / EXPERTS_BIN).read_bytes() == (tmp_path / "converted" / EXPERTS_BIN).read_bytes()
    ours, theirs = tensors_of(direct / DENSE_FILE), tensors_of(tmp_path / "converted" / DENSE_FILE)
    assert list(ours) == list(theirs)
    for name in theirs:
        assert ours[name].dtype == theirs[name].dtype and np.array_equal(ours[name], theirs[name]), name
    info = read_container_info(direct)
    assert (info.bits, info.dense_bits, info.n_experts, info.layer_offsets) == (
        bits, dense_bits, 256, converted.layer_offsets)


def test_cli_writes_a_container_the_engine_runs(tmp_path):
    out = tmp_path / "c"
    proc = run_cli("make-synthetic", "--arch", "qwen3_moe", "--layers", "2", "--experts", "16", "--hidden", "128",
                   "--moe-inter", "64", "--vocab", "512", "--bits", "4", "--dense-bits", "8", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    assert read_container_info(out).dense_bits == 8 and (out / "tokenizer.json").is_file()
    proc = run_cli("generate", "--model", str(out), "--prompt", "hi", "-n", "3", "--json")
    assert proc.returncode == 0, proc.stderr
    bad = run_cli("make-synthetic", "--arch", "qwen3_moe", "--layers", "2", "--experts", "16", "--hidden", "100",
                  "--out", str(tmp_path / "bad"))
    assert bad.returncode == 2 and "--hidden" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("arch", ["qwen3_5_moe", "qwen3_moe"])
def test_config_json_is_what_transformers_writes(arch, tmp_path):
    """The hand-written config.json loads in transformers as the config class built with transformers."""
    from transformers import AutoConfig

    from tierlab.app.cli.cmd_make_synthetic import synthetic_config

    (tmp_path / "config.json").write_text(json.dumps(config_json(real_shape(arch, 5, 16, 8, 4096))))
    ours = AutoConfig.from_pretrained(tmp_path).to_dict()
    theirs = synthetic_config(arch, 5, 16, 8, 4096).to_dict()
    for key in ("transformers_version", "architectures", "dtype", "_name_or_path"):
        ours.pop(key, None), theirs.pop(key, None)
    assert ours == theirs


@pytest.mark.parametrize("arch", ["qwen3_5_moe", "qwen3_moe"])
def test_transformers_loads_the_folder_and_matches_the_engine(arch, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    from tierlab.engine.model import load_engine

    shape = small(arch, layers=4, experts=16)
    write_hf_folder(shape, 1, tmp_path, shard_bytes=1 << 20)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    ids = [int(i) for i in np.random.default_rng(2).integers(3, 500, 12)]
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0].numpy()
    logits = load_engine(tmp_path, with_tokenizer=False, warmup=False).prefill(ids, all_logits=True)
    assert np.abs(logits - ref).max() / np.abs(ref).max() < 1e-4


def test_logits_stay_finite_over_40_layers(tmp_path):
    from tierlab.engine.model import load_engine

    write_container(small(layers=40, experts=8), 0, tmp_path, bits=4)
    (tmp_path / "tokenizer.json").unlink(missing_ok=True)
    engine = load_engine(tmp_path, with_tokenizer=False, warmup=False)
    logits = engine.prefill(list(range(3, 35)), all_logits=True)
    assert np.isfinite(logits).all() and 0 < np.abs(logits).max() < 100
    assert np.isfinite(engine.step(7)).all()


@pytest.mark.parametrize("fmt", ["hf", "container"])
def test_peak_memory_is_about_one_tensor_not_a_layer(tmp_path, fmt):
    """tracemalloc sees numpy's buffers: the writers hold one tensor (or one expert) at a time."""
    shape = small(layers=4, experts=64, hidden=256, moe_inter=256)
    layer_bytes = shape.experts * sum(t.nbytes for t in expert_tensors(shape, 0, 0))
    largest = max(t.nbytes for t in dense_tensors(shape))
    warm = tmp_path / "warm"  # the quantile table and the compiled quantisers, built once per process
    warm.mkdir()
    write_container(small(layers=1, experts=1), 0, warm, bits=4, dense_bits=4)
    target = tmp_path / "out"
    target.mkdir()
    tracemalloc.start()
    try:
        if fmt == "hf":
            write_hf_folder(shape, 0, target)
        else:
            write_container(shape, 0, target, bits=4, dense_bits=4)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    total = sum(f.stat().st_size for f in target.iterdir())
    assert total > layer_bytes  # four layers were written (int4 is a quarter of bf16)
    assert peak < layer_bytes / 4 and peak < 16 * max(largest, layer_bytes // shape.experts)


def test_the_blob_writer_refuses_a_wrong_size_and_a_missing_blob(tmp_path):
    from tierlab.engine.container import ExpertBlobWriter, new_container_info
    from tierlab.engine.errors import ModelError

    info = new_container_info(4, 2, 3, 128, 64, "test", "model.")
    writer = ExpertBlobWriter(tmp_path, info)
    with pytest.raises(ValueError, match="bytes"):
        writer.add(0, 0, np.zeros(info.blob_nbytes - 1, dtype=np.uint8))
    with pytest.raises(IndexError):
        writer.add(2, 0, np.zeros(info.blob_nbytes, dtype=np.uint8))
    for layer, expert in [(1, 2), (0, 0), (0, 1), (0, 2), (1, 0)]:  # any order; (1, 1) never
        writer.add(layer, expert, np.full(info.blob_nbytes, 7 * layer + expert, dtype=np.uint8))
    with pytest.raises(ModelError, match=r"1 blobs were never written, the first \(1, 1\)"):
        writer.finish()
    with ExpertBlobWriter(tmp_path, info) as writer:
        for layer in range(2):
            for expert in range(3):
                writer.add(layer, expert, np.full(info.blob_nbytes, 7 * layer + expert, dtype=np.uint8))
    data = (tmp_path / EXPERTS_BIN).read_bytes()
    assert len(data) == info.blob_offset(1, 2) + info.blob_stride  # the last blob padded too, as convert wrote it
    assert data[info.blob_offset(1, 2)] == 9 and data[info.blob_offset(0, 1)] == 1
