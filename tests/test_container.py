"""Converter and ContainerExpertSource on tiny checkpoints of both layouts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from tierlab.app.cli.main import main as cli_main
from tierlab.engine import quant as Q
from tierlab.engine.blob_layout import BlobLayout
from tierlab.engine.container import (
    CONTAINER_JSON, DENSE_FILE, EXPERTS_BIN, ContainerExpertSource, convert, read_container_info,
)
from tierlab.engine.errors import ModelError

HIDDEN, INTER, LAYERS, EXPERTS = 128, 64, 2, 4


def _hf_model(arch: str, dtype: str):
    """A tiny transformers model with dims that are multiples of 64, random weights."""
    import torch
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig, Qwen3MoeConfig, Qwen3MoeForCausalLM

    common = dict(vocab_size=256, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=32, moe_intermediate_size=INTER, num_experts=EXPERTS,
                  num_experts_per_tok=2, max_position_embeddings=64, tie_word_embeddings=False)
    torch.manual_seed(7)
    if arch == "qwen3_5_moe":
        cfg = Qwen3_5MoeTextConfig(linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=32,
                                   linear_value_head_dim=32, shared_expert_intermediate_size=64,
                                   full_attention_interval=2, **common)
        model = Qwen3_5MoeForCausalLM(cfg)
    else:
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(intermediate_size=128, norm_topk_prob=True, **common))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.1)
    return model.to(getattr(torch, dtype)).eval()


def _saved_tensors(folder: Path) -> dict[str, np.ndarray]:
    """Every tensor save_pretrained wrote, as float32 (bf16 widens exactly)."""
    from safetensors import safe_open

    out = {}
    for path in folder.glob("*.safetensors"):
        with safe_open(str(path), framework="np") as f:
            out.update({k: f.get_tensor(k).astype(np.float32) for k in f.keys()})
    return out


def _experts_of(saved: dict, prefix: str, layer: int) -> list[tuple[np.ndarray, ...]]:
    """float64 (gate, up, down) per expert, from the per-expert names save_pretrained writes."""
    out = []
    for e in range(EXPERTS):
        base = f"{prefix}layers.{layer}.mlp.experts.{e}."
        out.append(tuple(saved[base + f"{p}_proj.weight"].astype(np.float64) for p in ("gate", "up", "down")))
    return out


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """name -> (folder, {layer: [(gate, up, down) float64 per expert]}, dense {name: array})."""
    root = tmp_path_factory.mktemp("ckpt")
    result = {}
    for arch, dtype in (("qwen3_moe", "bfloat16"), ("qwen3_5_moe", "float32")):
        model = _hf_model(arch, dtype)
        folder = root / arch
        model.save_pretrained(folder, safe_serialization=True)
        saved = _saved_tensors(folder)
        experts = {layer: _experts_of(saved, "model.", layer) for layer in range(LAYERS)}
        dense = {k: v for k, v in saved.items() if ".mlp.experts." not in k}
        result[arch] = (folder, experts, dense)
    result["fused_vl"] = _write_fused_vl(root / "fused_vl")
    return result


def _write_fused_vl(folder: Path):
    """Hand-written VL-style checkpoint: nested text_config, `model.language_model.` prefix,
    fused gate_up_proj [E, 2I, H] / down_proj [E, H, I] in fp16, two shards, visual and mtp tensors."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(3)
    folder.mkdir(parents=True)
    cfg = {"model_type": "qwen3_5_moe", "architectures": ["Qwen3_5MoeForConditionalGeneration"],
           "text_config": {"model_type": "qwen3_5_moe_text", "num_hidden_layers": LAYERS, "num_experts": EXPERTS,
                           "hidden_size": HIDDEN, "moe_intermediate_size": INTER, "num_experts_per_tok": 2,
                           "vocab_size": 256, "num_attention_heads": 2}}
    (folder / "config.json").write_text(json.dumps(cfg))
    (folder / "tokenizer.json").write_text("{}")
    experts, dense, shards, weight_map = {}, {}, [{}, {}], {}
    for layer in range(LAYERS):
        gu = (rng.standard_normal((EXPERTS, 2 * INTER, HIDDEN)) * 0.1).astype(np.float16)
        dn = (rng.standard_normal((EXPERTS, HIDDEN, INTER)) * 0.1).astype(np.float16)
        base = f"model.language_model.layers.{layer}."
        shards[layer % 2][base + "mlp.experts.gate_up_proj"] = gu
        shards[layer % 2][base + "mlp.experts.down_proj"] = dn
        norm = rng.standard_normal(HIDDEN).astype(np.float16)
        shards[layer % 2][base + "input_layernorm.weight"] = norm
        dense[base + "input_layernorm.weight"] = norm.astype(np.float32)
        experts[layer] = [(gu[e, :INTER].astype(np.float64), gu[e, INTER:].astype(np.float64), dn[e].astype(np.float64))
                          for e in range(EXPERTS)]
    shards[0]["lm_head.weight"] = lm = (rng.standard_normal((256, HIDDEN))).astype(np.float16)
    dense["lm_head.weight"] = lm.astype(np.float32)
    shards[1]["model.visual.blocks.0.mlp.experts.0.weight"] = np.ones((2, 2), np.float16)
    shards[1]["mtp.layers.0.mlp.experts.0.gate_proj.weight"] = np.ones((2, 2), np.float16)
    for i, tensors in enumerate(shards):
        name = f"model-0000{i + 1}-of-00002.safetensors"
        save_file(tensors, str(folder / name))
        weight_map.update({k: name for k in tensors})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return folder, experts, dense


@pytest.fixture(scope="module")
def containers(checkpoints, tmp_path_factory):
    root = tmp_path_factory.mktemp("cont")
    out = {}
    for name, (folder, _, _) in checkpoints.items():
        for bits in (4, 8):
            convert(folder, root / f"{name}-{bits}", bits=bits)
            out[name, bits] = root / f"{name}-{bits}"
    return out


@pytest.mark.parametrize("name", ["qwen3_moe", "qwen3_5_moe", "fused_vl"])
@pytest.mark.parametrize("bits", [4, 8])
def test_read_and_forward_match_float64_reference(checkpoints, containers, name, bits):
    _, experts, _ = checkpoints[name]
    folder = containers[name, bits]
    rng = np.random.default_rng(bits)
    with ContainerExpertSource(folder) as src:
        assert (src.kind, src.hidden, src.inter) == (f"int{bits}", HIDDEN, INTER)
        slot = np.empty(src.blob_nbytes + 4096, dtype=np.uint8)
        for layer in range(LAYERS):
            for e in (0, EXPERTS - 1):
                src.read(layer, e, slot)
                gate, up, down = experts[layer][e]
                expected_blob = Q.build_blob(gate, up, down, bits)
                np.testing.assert_array_equal(slot[: src.blob_nbytes], expected_blob)
                x = rng.standard_normal(HIDDEN).astype(np.float32)
                y = np.zeros(HIDDEN, dtype=np.float32)
                src.forward(slot, x, y, 0.5)
                ref = 0.5 * Q.expert_reference(*Q.blob_matrices(expected_blob, bits, HIDDEN, INTER), x)
                assert np.abs(y - ref).max() <= 1e-5 * np.abs(ref).max()


@pytest.mark.parametrize("name", ["qwen3_moe", "qwen3_5_moe", "fused_vl"])
def test_dense_file_holds_every_non_expert_tensor(checkpoints, containers, name):
    from safetensors import safe_open

    _, _, dense = checkpoints[name]
    folder = containers[name, 4]
    with safe_open(str(folder / DENSE_FILE), framework="np") as f:
        keys = set(f.keys())
        assert keys == set(dense)
        for k in keys:
            t = f.get_tensor(k)
            assert t.dtype in (ml_dtypes.bfloat16, np.float16)  # fp32 sources are stored as bf16
            src = dense[k].astype(t.dtype).astype(np.float32)
            np.testing.assert_array_equal(t.astype(np.float32), src)
    assert (folder / "config.json").is_file()


def test_metadata_and_alignment(containers):
    info = read_container_info(containers["fused_vl", 4])
    assert info.prefix == "model.language_model."
    assert (info.n_layers, info.n_experts, info.hidden, info.inter, info.bits, info.group) == (LAYERS, EXPERTS, HIDDEN, INTER, 4, 64)
    assert info.blob_stride % 4096 == 0 and all(o % 4096 == 0 for o in info.layer_offsets)
    raw = json.loads((containers["fused_vl", 4] / CONTAINER_JSON).read_text())
    assert raw["format"] == "tierlab-experts" and raw["version"] == 2 and raw["blob_nbytes"] == BlobLayout("int4", HIDDEN, INTER).nbytes


def test_refuses_to_overwrite_without_force(checkpoints, tmp_path, capsys):
    folder = checkpoints["qwen3_moe"][0]
    out = tmp_path / "c"
    convert(folder, out, bits=4)  # --force replaces only a tierlab container
    (out / "keep.txt").write_text("x")
    assert cli_main(["convert", "--model", str(folder), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--force" in err and str(out) in err
    assert (out / "keep.txt").exists()
    assert cli_main(["convert", "--model", str(folder), "--out", str(out), "--bits", "8", "--force"]) == 0
    assert not (out / "keep.txt").exists() and read_container_info(out).bits == 8
    assert not out.with_name("c.partial").exists()


def test_truncated_experts_bin_is_a_one_line_error(containers, tmp_path):
    import shutil

    folder = tmp_path / "t"
    shutil.copytree(containers["qwen3_moe", 4], folder)
    with open(folder / EXPERTS_BIN, "r+b") as f:
        f.truncate(f.seek(0, 2) - 4096 * 10)
    with pytest.raises(ModelError) as exc:
        ContainerExpertSource(folder)
    msg = str(exc.value)
    assert "\n" not in msg and EXPERTS_BIN in msg and "truncated" in msg
    proc = subprocess.run([sys.executable, "-m", "tierlab", "inspect", str(folder)], capture_output=True, text=True)
    assert proc.returncode == 2 and "truncated" in proc.stderr  # inspect refuses what loading refuses


def test_bad_metadata_is_a_one_line_error(containers, tmp_path):
    import shutil

    folder = tmp_path / "b"
    shutil.copytree(containers["qwen3_moe", 8], folder)
    meta = json.loads((folder / CONTAINER_JSON).read_text())
    meta["blob_nbytes"] += 1
    (folder / CONTAINER_JSON).write_text(json.dumps(meta))
    with pytest.raises(ModelError, match="blob_nbytes") as exc:
        ContainerExpertSource(folder)
    assert CONTAINER_JSON in str(exc.value) and "\n" not in str(exc.value)
    (folder / CONTAINER_JSON).write_text("{not json")
    with pytest.raises(ModelError, match=CONTAINER_JSON):
        read_container_info(folder)


def test_dims_not_multiple_of_64_are_refused(tmp_path):
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen3_moe", "num_hidden_layers": 1, "num_local_experts": 2,
                                                     "hidden_size": 96, "moe_intermediate_size": 64, "num_experts_per_tok": 1,
                                                     "vocab_size": 256, "num_attention_heads": 2}))
    with pytest.raises(ModelError, match="multiples of 64") as exc:
        convert(folder, tmp_path / "out")
    assert "\n" not in str(exc.value)


def test_inspect_prints_summaries(containers, checkpoints, capsys):
    assert cli_main(["inspect", str(containers["fused_vl", 4])]) == 0
    text = capsys.readouterr().out
    assert "int4" in text and "bytes per expert" in text and "dense bytes" in text
    assert cli_main(["inspect", str(checkpoints["fused_vl"][0])]) == 0
    text = capsys.readouterr().out
    assert "fused layout" in text and "model.language_model." in text


def test_only_group_64_is_accepted(checkpoints, tmp_path):
    with pytest.raises(ModelError, match="--group must be 64"):
        convert(checkpoints["qwen3_moe"][0], tmp_path / "g", group=32)


@pytest.mark.parametrize("arch", ["qwen3_5_moe", "qwen3_moe"])
def test_synthetic_config_has_the_real_per_layer_shapes(arch):
    from tierlab.app.cli.cmd_make_synthetic import synthetic_config

    cfg = synthetic_config(arch, layers=2, experts=16, top_k=8, vocab=4096)
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_experts, cfg.num_experts_per_tok, cfg.vocab_size) == (2048, 2, 16, 8, 4096)
    if arch == "qwen3_5_moe":
        assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.moe_intermediate_size) == (16, 2, 256, 512)
        assert (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim) == (16, 32, 128)
        assert cfg.shared_expert_intermediate_size == 512 and "full_attention" in cfg.layer_types
        assert cfg.rope_parameters["rope_theta"] == 1e7 and cfg.rope_parameters["partial_rotary_factor"] == 0.25
    else:
        assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.moe_intermediate_size) == (32, 4, 128, 768)
        assert cfg.norm_topk_prob is True


@pytest.mark.parametrize("arch", ["qwen3_5_moe", "qwen3_moe"])
def test_synthetic_config_reads_back_through_the_engine_parser(arch):
    from tierlab.app.cli.cmd_make_synthetic import synthetic_config
    from tierlab.engine.config import parse_config

    cfg = synthetic_config(arch, layers=5, experts=16, top_k=8, vocab=4096)
    parsed = parse_config(cfg.to_dict(), Path("config.json"))
    assert parsed.arch == arch
    assert (parsed.hidden_size, parsed.n_layers, parsed.n_experts, parsed.top_k, parsed.vocab_size) == (2048, 5, 16, 8, 4096)
    assert (parsed.n_heads, parsed.n_kv_heads, parsed.head_dim, parsed.moe_inter) == (
        cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.moe_intermediate_size)
    assert parsed.layer_types == list(getattr(cfg, "layer_types", None) or ["full_attention"] * 5)
    assert parsed.rope_theta == cfg.rope_parameters["rope_theta"]


@pytest.mark.parametrize("arch", ["qwen3_5_moe", "qwen3_moe"])
def test_synthetic_weights_are_what_save_pretrained_writes(checkpoints, tmp_path, arch):
    """make-synthetic streams the state dict itself: same names, dtypes and bytes as save_pretrained."""
    from tierlab.app.cli.cmd_make_synthetic import write_weights

    dtype = "bfloat16" if arch == "qwen3_moe" else "float32"
    write_weights(_hf_model(arch, dtype).state_dict(), tmp_path / "model.safetensors")
    from tierlab.engine.safetensors_file import read_header

    ours, theirs = _saved_tensors(tmp_path), _saved_tensors(checkpoints[arch][0])
    kinds = [{k: (i.dtype, i.shape) for k, i in read_header(next(folder.glob("*.safetensors"))).items()}
             for folder in (tmp_path, checkpoints[arch][0])]
    assert kinds[0] == kinds[1]
    for name, value in theirs.items():
        np.testing.assert_array_equal(ours[name], value, err_msg=name)


def test_synthetic_tokenizer_round_trips_bytes(tmp_path):
    from tokenizers import Tokenizer

    from tierlab.app.cli.cmd_make_synthetic import write_tokenizer

    write_tokenizer(tmp_path, 512)
    tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert tok.get_vocab_size() == 512
    text = "héllo <|im_end|> wörld\n"
    ids = tok.encode(text).ids
    assert tok.token_to_id("<|im_end|>") in ids and tok.decode(ids, skip_special_tokens=False) == text
    assert tok.encode("A").ids == [65]  # byte tokens sit at their byte values


def test_never_overwrites_the_source_checkpoint(checkpoints):
    folder = checkpoints["qwen3_moe"][0]
    with pytest.raises(ModelError, match="model folder"):
        convert(folder, folder, force=True)
    with pytest.raises(ModelError, match="model folder"):
        convert(folder, folder / "inside", force=True)
    assert (folder / "config.json").is_file()


def test_read_rejects_a_short_slot_and_bad_indices(containers):
    with ContainerExpertSource(containers["qwen3_moe", 4]) as src:
        with pytest.raises(ValueError, match="smaller than one expert"):
            src.read(0, 0, np.empty(src.blob_nbytes - 1, dtype=np.uint8))
        with pytest.raises(IndexError):
            src.read(LAYERS, 0, np.empty(src.blob_nbytes, dtype=np.uint8))
