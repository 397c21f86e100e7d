#!/usr/bin/env python3
"""A GGUF (llama.cpp's `qwen35moe` architecture) of the same seeded weights `tierlab make-synthetic` writes.

Not part of tierlab and not run by CI: it needs gguf-py (`pip install gguf`),
which lives in the separate llama.cpp venv. Run it with that venv's python and
tierlab importable, next to a make-synthetic output of the same seed (a
container or a Hugging Face folder; its config.json gives the shape, its
tokenizer.json the vocabulary):

    PYTHONPATH=/path/above/tierlab /work/llama-venv/bin/python bench/synthetic_gguf.py \
        --model /work/big/q36-int4 --seed 0 --out /work/big/q36-q4_0.gguf

Why: the real-scale benchmark puts llama.cpp next to tierlab on the full
40 x 256 shape, and that needs the *same* weights in both files. Converting
through transformers would need the 65 GB bf16 folder and torch; here every
tensor is drawn with tierlab's own generator (engine/synthetic.py: the same
(seed, name) gives the same bf16 values) and written straight into the GGUF,
one tensor at a time (one layer's stack of one expert matrix at most).

What the GGUF holds, as llama.cpp's loader for `qwen35moe` expects it:
routed experts stacked per layer (`blk.N.ffn_{gate,up,down}_exps`) in Q4_0
(`--experts bf16`: the generator's values exactly, the layout check on small
shapes, docs/benchmarks.md "The same weights as a GGUF");
every other matrix in BF16 (`--dense bf16`, as tierlab's container keeps
them), Q4_0 (`--dense q4_0`) or Q4_0 exactly where a `--dense-bits 4` container
has int4 (`--dense q4_0-like-container`: the projections and lm_head; the
embedding and the routers BF16); norms, the DeltaNet convolution, A and dt in
F32. The value heads of the DeltaNet projections are reordered from the
grouped order of the checkpoint to the tiled order llama.cpp broadcasts with,
A is stored as -exp(A_log), and the norms Qwen3.5 scales by 1 + w hold 1 + w:
the conventions of llama.cpp's own converter, so the model computes the same
function. tierlab's int4 (groups of 64) and Q4_0 (blocks of 32) round the same
bf16 values differently, so logits agree closely but not bit for bit.

The tokenizer is the synthetic's byte-level vocabulary with one dummy BPE
merge (llama.cpp insists on the key); benchmarks feed token ids directly.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

import gguf
from gguf import GGMLQuantizationType as QT
from gguf import MODEL_TENSOR as T

from tierlab.engine.config import QWEN3_5_MOE
from tierlab.engine.container import quantises
from tierlab.engine.synthetic import (
    SyntheticShape, config_json, dense_tensors, expert_tensors, real_shape, values,
)

ARCH = gguf.MODEL_ARCH.QWEN35MOE
ARCH_NAME = gguf.MODEL_ARCH_NAMES[ARCH]
MROPE_SECTIONS = [11, 11, 10, 0]  # Qwen3.5's interleaved MRoPE; text positions make it plain RoPE
DENSE_TYPES = {"bf16": QT.BF16, "q4_0": QT.Q4_0}
# Q4_0 for exactly the matrices a container's --dense-bits 4 stores at 4 bits (the projections and
# lm_head), BF16 for the rest (the embedding, the routers): the equal-bits partner of such a container
LIKE_CONTAINER = "q4_0-like-container"
NORM_PLUS_ONE = ("input_layernorm", "post_attention_layernorm", "q_norm", "k_norm")


def shape_from_config(cfg: dict) -> SyntheticShape:
    """The synthetic shape a make-synthetic config.json was written for (checked by writing it back)."""
    if cfg.get("model_type") != "qwen3_5_moe_text":
        raise SystemExit(f"config.json: model_type {cfg.get('model_type')!r}; only qwen3_5_moe is written")
    rope = cfg["rope_parameters"]
    shape = real_shape(
        QWEN3_5_MOE, cfg["num_hidden_layers"], cfg["num_experts"], cfg["num_experts_per_tok"], cfg["vocab_size"],
        hidden=cfg["hidden_size"], moe_inter=cfg["moe_intermediate_size"],
        shared_inter=cfg["shared_expert_intermediate_size"], n_heads=cfg["num_attention_heads"],
        n_kv_heads=cfg["num_key_value_heads"], head_dim=cfg["head_dim"], lin_k_heads=cfg["linear_num_key_heads"],
        lin_v_heads=cfg["linear_num_value_heads"], lin_k_dim=cfg["linear_key_head_dim"],
        lin_v_dim=cfg["linear_value_head_dim"], conv_kernel=cfg["linear_conv_kernel_dim"],
        rope_theta=rope["rope_theta"], partial_rotary=rope["partial_rotary_factor"],
        max_positions=cfg["max_position_embeddings"])
    if config_json(shape) != dict(sorted(cfg.items())):
        raise SystemExit("config.json is not one make-synthetic writes (its shape does not round-trip)")
    return shape


def f32(bits: np.ndarray) -> np.ndarray:
    """bf16 bits as float32 values (exact)."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


def tiled_v_heads(a: np.ndarray, axis: int, k_heads: int, v_heads: int, head_dim: int) -> np.ndarray:
    """Value heads from grouped order [k0: v0..v{r-1}, k1: ...] to tiled order [v0 of k0, v0 of k1, ...]."""
    a = np.moveaxis(a, axis, 0)
    rest = a.shape[1:]
    per = v_heads // k_heads
    a = a.reshape(k_heads, per, head_dim, *rest).swapaxes(0, 1).reshape(v_heads * head_dim, *rest)
    return np.ascontiguousarray(np.moveaxis(a, 0, axis))


class Plan:
    """GGUF tensors in write order: (name, numpy byte/values shape, ggml type, nbytes, producer)."""

    def __init__(self):
        self.items: list[tuple[str, tuple, QT, int, object]] = []

    def add(self, name: str, shape: tuple, qtype: QT, make) -> None:
        if qtype == QT.F32:
            nbytes, stored = 4 * int(np.prod(shape)), shape
        elif qtype == QT.BF16:
            nbytes, stored = 2 * int(np.prod(shape)), shape
        else:
            block, size = gguf.GGML_QUANT_SIZES[qtype]
            stored = (*shape[:-1], shape[-1] // block * size)
            nbytes = int(np.prod(stored))
        self.items.append((name, stored, qtype, nbytes, make))


def encode(arr: np.ndarray, qtype: QT) -> np.ndarray:
    """float32 values in the stored form of `qtype`."""
    if qtype == QT.F32:
        return np.ascontiguousarray(arr, dtype=np.float32)
    if qtype == QT.BF16:
        bits = np.ascontiguousarray(arr, dtype=np.float32).view(np.uint32)
        return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)  # round to nearest even
    return gguf.quants.quantize(np.ascontiguousarray(arr, dtype=np.float32), qtype)


def plan_tensors(shape: SyntheticShape, seed: int, dense: str, expert_type: QT = QT.Q4_0) -> Plan:
    """Every tensor of the GGUF, each with a function that draws and converts it when written."""
    by_name = {t.name: t for t in dense_tensors(shape)}
    kh, vh, kd, vd = shape.lin_k_heads, shape.lin_v_heads, shape.lin_k_dim, shape.lin_v_dim
    key = kh * kd
    plan = Plan()

    def draw(name: str) -> np.ndarray:
        return f32(values(seed, by_name[name]))

    def matrix(gguf_name: str, hf_name: str, fix=None) -> None:
        rows, cols = by_name[hf_name].shape
        if dense == LIKE_CONTAINER:
            qtype = QT.Q4_0 if quantises(hf_name, "BF16", [rows, cols], 4) else QT.BF16
        else:
            qtype = DENSE_TYPES[dense] if cols % 32 == 0 else QT.BF16
        plan.add(gguf_name, (rows, cols), qtype,
                 lambda: encode(fix(draw(hf_name)) if fix else draw(hf_name), qtype))

    def vector(gguf_name: str, hf_name: str, fix=None, shape_=None) -> None:
        n = int(np.prod(by_name[hf_name].shape))
        out_shape = shape_ or (n,)
        plan.add(gguf_name, out_shape, QT.F32,
                 lambda: encode((fix(draw(hf_name)) if fix else draw(hf_name)).reshape(out_shape), QT.F32))

    def name(tensor: T, bid: int | None = None, suffix: str = ".weight") -> str:
        base = gguf.TENSOR_NAMES[tensor]
        return (base.format(bid=bid) if bid is not None else base) + suffix

    P = "model."
    plus_one = lambda a: a + np.float32(1.0)  # noqa: E731 - Qwen3.5 stores 1 + w norms as w
    v_rows = lambda d: (lambda a: tiled_v_heads(a, 0, kh, vh, d))  # noqa: E731

    def qkv_fix(a: np.ndarray) -> np.ndarray:
        return np.concatenate([a[:2 * key], tiled_v_heads(a[2 * key:], 0, kh, vh, vd)])

    def conv_fix(a: np.ndarray) -> np.ndarray:
        a = a.reshape(a.shape[0], shape.conv_kernel)
        return np.concatenate([a[:2 * key], tiled_v_heads(a[2 * key:], 0, kh, vh, vd)])

    for i, kind in enumerate(shape.layer_types):
        p = f"{P}layers.{i}."
        vector(name(T.ATTN_NORM, i), p + "input_layernorm.weight", plus_one)
        vector(name(T.ATTN_POST_NORM, i), p + "post_attention_layernorm.weight", plus_one)
        if kind == "full_attention":
            matrix(name(T.ATTN_Q, i), p + "self_attn.q_proj.weight")
            matrix(name(T.ATTN_K, i), p + "self_attn.k_proj.weight")
            matrix(name(T.ATTN_V, i), p + "self_attn.v_proj.weight")
            matrix(name(T.ATTN_OUT, i), p + "self_attn.o_proj.weight")
            vector(name(T.ATTN_Q_NORM, i), p + "self_attn.q_norm.weight", plus_one)
            vector(name(T.ATTN_K_NORM, i), p + "self_attn.k_norm.weight", plus_one)
        else:
            la = p + "linear_attn."
            matrix(name(T.ATTN_QKV, i), la + "in_proj_qkv.weight", qkv_fix)
            matrix(name(T.ATTN_GATE, i), la + "in_proj_z.weight", v_rows(vd))
            matrix(name(T.SSM_BETA, i), la + "in_proj_b.weight", v_rows(1))
            matrix(name(T.SSM_ALPHA, i), la + "in_proj_a.weight", v_rows(1))
            conv_rows = 2 * key + vh * vd
            vector(name(T.SSM_CONV1D, i), la + "conv1d.weight", conv_fix, (conv_rows, shape.conv_kernel))
            vector(name(T.SSM_DT, i, ".bias"), la + "dt_bias", lambda a: tiled_v_heads(a, 0, kh, vh, 1))
            vector(name(T.SSM_A, i, ""), la + "A_log", lambda a: -np.exp(tiled_v_heads(a, 0, kh, vh, 1)))
            vector(name(T.SSM_NORM, i), la + "norm.weight")
            matrix(name(T.SSM_OUT, i), la + "out_proj.weight", lambda a: tiled_v_heads(a, 1, kh, vh, vd))
        matrix(name(T.FFN_GATE_INP, i), p + "mlp.gate.weight")
        if shape.shared_inter:
            matrix(name(T.FFN_GATE_SHEXP, i), p + "mlp.shared_expert.gate_proj.weight")
            matrix(name(T.FFN_UP_SHEXP, i), p + "mlp.shared_expert.up_proj.weight")
            matrix(name(T.FFN_DOWN_SHEXP, i), p + "mlp.shared_expert.down_proj.weight")
            vector(name(T.FFN_GATE_INP_SHEXP, i), p + "mlp.shared_expert_gate.weight")
        for which, tensor in enumerate((T.FFN_GATE_EXP, T.FFN_UP_EXP, T.FFN_DOWN_EXP)):
            rows, cols = expert_tensors(shape, i, 0)[which].shape
            plan.add(name(tensor, i), (shape.experts, rows, cols), expert_type,
                     lambda i=i, which=which: expert_stack(shape, seed, i, which, expert_type))
    matrix(name(T.TOKEN_EMBD), P + "embed_tokens.weight")
    vector(name(T.OUTPUT_NORM), P + "norm.weight", plus_one)
    matrix(name(T.OUTPUT), "lm_head.weight")
    return plan


def expert_stack(shape: SyntheticShape, seed: int, layer: int, which: int, qtype: QT = QT.Q4_0) -> np.ndarray:
    """One layer's gate, up or down matrices of every expert, drawn and quantised one expert at a time."""
    rows, cols = expert_tensors(shape, layer, 0)[which].shape
    if qtype == QT.BF16:  # the generator's bf16 bits as they are
        return np.stack([values(seed, expert_tensors(shape, layer, e)[which]) for e in range(shape.experts)])
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    out = np.empty((shape.experts, rows, cols // block * size), dtype=np.uint8)
    for e in range(shape.experts):
        out[e] = gguf.quants.quantize(f32(values(seed, expert_tensors(shape, layer, e)[which])), qtype)
    return out


def add_metadata(w: gguf.GGUFWriter, shape: SyntheticShape, cfg: dict, tokenizer: dict, experts: str, dense: str,
                 seed: int) -> None:
    w.add_name(f"tierlab make-synthetic seed {seed} ({shape.layers}x{shape.experts}, experts {experts}, dense {dense})")
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_0 if experts == "q4_0" else gguf.LlamaFileType.MOSTLY_BF16)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_context_length(shape.max_positions)
    w.add_embedding_length(shape.hidden)
    w.add_block_count(shape.layers)
    w.add_head_count(shape.n_heads)
    w.add_head_count_kv(shape.n_kv_heads)
    w.add_key_length(shape.head_dim)
    w.add_value_length(shape.head_dim)
    w.add_rope_freq_base(shape.rope_theta)
    w.add_rope_dimension_count(int(shape.head_dim * shape.partial_rotary))
    w.add_rope_dimension_sections(MROPE_SECTIONS)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_expert_count(shape.experts)
    w.add_expert_used_count(shape.top_k)
    w.add_expert_feed_forward_length(shape.moe_inter)
    w.add_expert_shared_feed_forward_length(shape.shared_inter)
    w.add_ssm_conv_kernel(shape.conv_kernel)
    w.add_ssm_state_size(shape.lin_k_dim)
    w.add_ssm_group_count(shape.lin_k_heads)
    w.add_ssm_time_step_rank(shape.lin_v_heads)
    w.add_ssm_inner_size(shape.lin_v_dim * shape.lin_v_heads)
    w.add_full_attention_interval(min(4, shape.layers))
    # the vocabulary: tokenizer.json's byte-level BPE, ids in order
    vocab = tokenizer["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    if len(tokens) != shape.vocab or vocab[tokens[-1]] != shape.vocab - 1:
        raise SystemExit(f"tokenizer.json has {len(tokens)} tokens, config.json says {shape.vocab}")
    special = {t["id"] for t in tokenizer.get("added_tokens", [])}
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL if i in special or i >= 256 else gguf.TokenType.NORMAL
                       for i in range(len(tokens))])
    w.add_token_merges([f"{tokens[0]} {tokens[1]}"])  # llama.cpp requires the key; ids are fed directly
    w.add_eos_token_id(cfg["eos_token_id"])
    w.add_pad_token_id(cfg["pad_token_id"])
    w.add_add_bos_token(False)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="a make-synthetic output (container or folder) of the same seed")
    ap.add_argument("--seed", type=int, default=0, help="the make-synthetic seed (default 0)")
    ap.add_argument("--dense", choices=(*DENSE_TYPES, LIKE_CONTAINER), default="bf16",
                    help="the non-expert matrices: bf16 (as a container without --dense-bits), q4_0, or "
                         f"{LIKE_CONTAINER} (Q4_0 where a --dense-bits 4 container has int4, else BF16)")
    ap.add_argument("--experts", choices=tuple(DENSE_TYPES), default="q4_0",
                    help="the routed experts: q4_0 (default) or bf16 (exact values: the layout check on small shapes)")
    ap.add_argument("--out", required=True, help="the .gguf file to write")
    a = ap.parse_args()
    model = Path(a.model)
    cfg = json.loads((model / "config.json").read_text())
    shape = shape_from_config(cfg)
    tokenizer = json.loads((model / "tokenizer.json").read_text())
    plan = plan_tensors(shape, a.seed, a.dense, DENSE_TYPES[a.experts])
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(out, ARCH_NAME)
    add_metadata(w, shape, cfg, tokenizer, a.experts, a.dense, a.seed)
    for tname, stored, qtype, nbytes, _ in plan.items:
        w.add_tensor_info(tname, stored, np.uint8 if qtype not in (QT.F32, QT.BF16) else
                          (np.float32 if qtype == QT.F32 else np.uint16), nbytes, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    total, t0 = sum(item[3] for item in plan.items), time.time()
    done = 0
    for k, (tname, stored, qtype, nbytes, make) in enumerate(plan.items):
        data = make()
        if data.nbytes != nbytes:
            raise SystemExit(f"{tname}: {data.nbytes} bytes, planned {nbytes}")
        w.write_tensor_data(data)
        done += nbytes
        if "_exps" in tname or k == len(plan.items) - 1:
            rate = done / max(time.time() - t0, 1e-9) / 2**20
            print(f"{tname}: {done / 2**30:.2f}/{total / 2**30:.2f} GiB, {rate:.1f} MiB/s, "
                  f"{time.time() - t0:.0f} s", file=sys.stderr, flush=True)
    w.close()
    print(json.dumps({"out": str(out), "bytes": out.stat().st_size, "tensors": len(plan.items),
                      "seconds": round(time.time() - t0, 1), "experts": a.experts, "dense": a.dense}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
