"""Random-weight checkpoints of any size, written layer by layer with numpy alone.

Why: the real checkpoints are 60-70 GB, and writing the full 40 x 256 shape
through transformers would need the whole model in memory first. Here every
tensor is drawn on its own from a generator seeded by (seed, tensor name), so
tensors can be written in any order, one at a time, to a Hugging Face folder
(bf16 safetensors under the names `save_pretrained` writes) or straight to a
tierlab container through the container's own writers; the same seed gives
the same weights in both. Peak memory is one tensor (one expert for the
container), never a layer.

The weights are scaled like a trained model's: projections and embeddings
normal with std 0.02, norms 1 (stored as 0 where Qwen3.5 scales by 1 + w),
the router with a wider std so that tokens have preferred experts.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path
from statistics import NormalDist
from typing import Callable, Iterator

import numpy as np

from tierlab.engine.checkpoint import to_f32
from tierlab.engine.config import QWEN3_5_MOE, QWEN3_MOE
from tierlab.engine.errors import ModelError
from tierlab.engine.safetensors_file import TensorSpec, write_file

ARCHS = (QWEN3_5_MOE, QWEN3_MOE)
WEIGHT_STD = 0.02  # projections, embeddings, the DeltaNet convolution
ROUTER_STD = 0.5  # mlp.gate: a router with preferences, not uniform noise
PREFIX = "model."
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DRAW_CHUNK = 1 << 22  # values drawn at a time (a multiple of 4, so the stream does not depend on it)
SPECIAL = {"bos_token_id": None, "eos_token_id": 258, "pad_token_id": 256}


@dataclass(frozen=True)
class SyntheticShape:
    """Every size a synthetic checkpoint has; `real_shape` gives the real models' per-layer ones."""

    arch: str
    layers: int
    experts: int
    top_k: int = 8
    vocab: int = 4096
    hidden: int = 2048
    moe_inter: int = 512
    shared_inter: int = 512  # qwen3_5_moe's shared expert
    dense_inter: int = 6144  # qwen3_moe's intermediate_size (no dense layers are written)
    n_heads: int = 16
    n_kv_heads: int = 2
    head_dim: int = 256
    lin_k_heads: int = 16
    lin_v_heads: int = 32
    lin_k_dim: int = 128
    lin_v_dim: int = 128
    conv_kernel: int = 4
    rope_theta: float = 10_000_000.0
    partial_rotary: float = 0.25
    max_positions: int = 262144

    @property
    def layer_types(self) -> list[str]:
        """Every 4th layer full attention, as in the real model; with fewer than 4 layers the
        last one is (transformers' cache needs at least one)."""
        if self.arch != QWEN3_5_MOE:
            return ["full_attention"] * self.layers
        interval = min(4, self.layers)
        return ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(self.layers)]

    def check(self) -> None:
        if self.arch not in ARCHS:
            raise ModelError(f"--arch must be one of {', '.join(ARCHS)}, got {self.arch!r}")
        if self.layers < 1 or self.experts < 1:
            raise ModelError("--layers and --experts must be at least 1")
        if not 1 <= self.top_k <= self.experts:
            raise ModelError(f"--top-k {self.top_k} must be between 1 and --experts ({self.experts})")
        if self.vocab < 259:
            raise ModelError("--vocab must be at least 259 (byte tokens and specials)")
        for name in ("hidden", "moe_inter"):
            value = getattr(self, name)
            if value < 64 or value % 64:
                raise ModelError(f"--{name.replace('_', '-')} must be a positive multiple of 64, got {value}")


def real_shape(arch: str, layers: int, experts: int, top_k: int = 8, vocab: int = 4096, **sizes) -> SyntheticShape:
    """Qwen3.6-35B-A3B's (qwen3_5_moe) or Qwen3-30B-A3B's (qwen3_moe) per-layer sizes; `sizes` override."""
    base = SyntheticShape(arch, layers, experts, top_k, vocab)
    if arch == QWEN3_MOE:
        base = replace(base, moe_inter=768, shared_inter=0, n_heads=32, n_kv_heads=4, head_dim=128,
                       lin_k_heads=0, lin_v_heads=0, lin_k_dim=0, lin_v_dim=0, rope_theta=1_000_000.0,
                       partial_rotary=1.0, max_positions=40960)
    return replace(base, **sizes)


# --- config.json --------------------------------------------------------------------------------


def config_json(shape: SyntheticShape) -> dict:
    """The config.json transformers' config class writes for this shape (Qwen3_5MoeTextConfig or
    Qwen3MoeConfig with dtype bfloat16), written without transformers."""
    common = {
        "attention_bias": False, "attention_dropout": 0.0, **SPECIAL, "dtype": "bfloat16",
        "head_dim": shape.head_dim, "hidden_act": "silu", "hidden_size": shape.hidden, "initializer_range": WEIGHT_STD,
        "max_position_embeddings": shape.max_positions, "moe_intermediate_size": shape.moe_inter,
        "num_attention_heads": shape.n_heads, "num_experts_per_tok": shape.top_k,
        "num_hidden_layers": shape.layers, "num_key_value_heads": shape.n_kv_heads, "output_router_logits": False,
        "rms_norm_eps": 1e-06, "router_aux_loss_coef": 0.001, "tie_word_embeddings": False, "use_cache": True,
        "vocab_size": shape.vocab,
    }
    if shape.arch == QWEN3_5_MOE:
        cfg = {
            "architectures": ["Qwen3_5MoeForCausalLM"], **common, "layer_types": shape.layer_types,
            "linear_conv_kernel_dim": shape.conv_kernel, "linear_key_head_dim": shape.lin_k_dim,
            "linear_num_key_heads": shape.lin_k_heads, "linear_num_value_heads": shape.lin_v_heads,
            "linear_value_head_dim": shape.lin_v_dim, "model_type": "qwen3_5_moe_text", "num_experts": shape.experts,
            "rope_parameters": {"partial_rotary_factor": shape.partial_rotary, "rope_theta": shape.rope_theta,
                                "rope_type": "default"},
            "shared_expert_intermediate_size": shape.shared_inter,
        }
    else:
        cfg = {
            "architectures": ["Qwen3MoeForCausalLM"], **common, "decoder_sparse_step": 1,
            "intermediate_size": shape.dense_inter, "mlp_only_layers": [], "model_type": "qwen3_moe",
            "norm_topk_prob": True, "num_local_experts": shape.experts,
            "rope_parameters": {"rope_theta": shape.rope_theta, "rope_type": "default"},
            "sliding_window": None, "use_sliding_window": False,
        }
    return dict(sorted(cfg.items()))


GENERATION_CONFIG = {"eos_token_id": SPECIAL["eos_token_id"], "pad_token_id": SPECIAL["pad_token_id"]}


# --- the tensors --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Planned:
    """One tensor to write: its stored name, shape and how its values are drawn."""

    name: str
    shape: tuple[int, ...]
    init: str  # "normal" | "router" | "zeros" | "ones" | "a_log"

    @property
    def nbytes(self) -> int:
        return 2 * int(np.prod(self.shape))


EXPERT_MATRICES = ("gate_proj", "up_proj", "down_proj")


def expert_tensors(shape: SyntheticShape, layer: int, expert: int) -> list[Planned]:
    """One expert's three matrices under the per-expert names `save_pretrained` writes."""
    base = f"{PREFIX}layers.{layer}.mlp.experts.{expert}."
    H, I = shape.hidden, shape.moe_inter
    return [Planned(base + "gate_proj.weight", (I, H), "normal"), Planned(base + "up_proj.weight", (I, H), "normal"),
            Planned(base + "down_proj.weight", (H, I), "normal")]


def dense_tensors(shape: SyntheticShape) -> list[Planned]:
    """Every non-expert tensor, in stored-name order."""
    H = shape.hidden
    norm = "zeros" if shape.arch == QWEN3_5_MOE else "ones"  # Qwen3.5 stores 1 + w norms as w
    out = [Planned(PREFIX + "embed_tokens.weight", (shape.vocab, H), "normal"),
           Planned(PREFIX + "norm.weight", (H,), norm), Planned("lm_head.weight", (shape.vocab, H), "normal")]
    for i, kind in enumerate(shape.layer_types):
        p = f"{PREFIX}layers.{i}."
        out += [Planned(p + "input_layernorm.weight", (H,), norm), Planned(p + "post_attention_layernorm.weight", (H,), norm),
                Planned(p + "mlp.gate.weight", (shape.experts, H), "router")]
        if kind == "full_attention":
            q_rows = shape.n_heads * shape.head_dim * (2 if shape.arch == QWEN3_5_MOE else 1)  # + the output gate
            kv_rows = shape.n_kv_heads * shape.head_dim
            out += [Planned(p + "self_attn.q_proj.weight", (q_rows, H), "normal"),
                    Planned(p + "self_attn.k_proj.weight", (kv_rows, H), "normal"),
                    Planned(p + "self_attn.v_proj.weight", (kv_rows, H), "normal"),
                    Planned(p + "self_attn.o_proj.weight", (H, shape.n_heads * shape.head_dim), "normal"),
                    Planned(p + "self_attn.q_norm.weight", (shape.head_dim,), norm),
                    Planned(p + "self_attn.k_norm.weight", (shape.head_dim,), norm)]
        else:
            key, value = shape.lin_k_heads * shape.lin_k_dim, shape.lin_v_heads * shape.lin_v_dim
            out += [Planned(p + "linear_attn.in_proj_qkv.weight", (2 * key + value, H), "normal"),
                    Planned(p + "linear_attn.in_proj_z.weight", (value, H), "normal"),
                    Planned(p + "linear_attn.in_proj_b.weight", (shape.lin_v_heads, H), "normal"),
                    Planned(p + "linear_attn.in_proj_a.weight", (shape.lin_v_heads, H), "normal"),
                    Planned(p + "linear_attn.conv1d.weight", (2 * key + value, 1, shape.conv_kernel), "normal"),
                    Planned(p + "linear_attn.dt_bias", (shape.lin_v_heads,), "ones"),
                    Planned(p + "linear_attn.A_log", (shape.lin_v_heads,), "a_log"),
                    Planned(p + "linear_attn.norm.weight", (shape.lin_v_dim,), "ones"),
                    Planned(p + "linear_attn.out_proj.weight", (H, value), "normal")]
        if shape.arch == QWEN3_5_MOE and shape.shared_inter:
            S = shape.shared_inter
            out += [Planned(p + "mlp.shared_expert.gate_proj.weight", (S, H), "normal"),
                    Planned(p + "mlp.shared_expert.up_proj.weight", (S, H), "normal"),
                    Planned(p + "mlp.shared_expert.down_proj.weight", (H, S), "normal"),
                    Planned(p + "mlp.shared_expert_gate.weight", (1, H), "normal")]
    return sorted(out, key=lambda t: t.name)


def all_tensors(shape: SyntheticShape) -> list[Planned]:
    """Every tensor of the Hugging Face folder, in stored-name order."""
    experts = [t for layer in range(shape.layers) for e in range(shape.experts) for t in expert_tensors(shape, layer, e)]
    return sorted(dense_tensors(shape) + experts, key=lambda t: t.name)


@lru_cache(maxsize=4)
def _normal_table(std: float) -> np.ndarray:
    """bf16 bits of the 65536 quantiles of N(0, std): one 16-bit draw becomes one normal value."""
    import ml_dtypes

    dist = NormalDist(0.0, std)
    q = np.array([dist.inv_cdf((i + 0.5) / 65536) for i in range(65536)], dtype=np.float32)
    return q.astype(ml_dtypes.bfloat16).view(np.uint16)


def _generator(seed: int, name: str) -> np.random.Generator:
    digest = hashlib.blake2b(name.encode(), digest_size=8).digest()
    return np.random.default_rng([seed, int.from_bytes(digest[:4], "little"), int.from_bytes(digest[4:], "little")])


def values(seed: int, tensor: Planned) -> np.ndarray:
    """The tensor's bf16 values (as uint16 bits), drawn from its own generator: the same for the
    same (seed, name) whatever else is written and in whatever order."""
    import ml_dtypes

    n = int(np.prod(tensor.shape))
    if tensor.init in ("zeros", "ones"):
        bits = np.full(n, 0 if tensor.init == "zeros" else 0x3F80, dtype=np.uint16)  # bf16 1.0 is 0x3F80
    elif tensor.init == "a_log":  # transformers' A ~ U(0, 16), kept away from log(0)
        a = _generator(seed, tensor.name).uniform(1.0, 16.0, n).astype(np.float32)
        bits = np.log(a).astype(ml_dtypes.bfloat16).view(np.uint16)
    else:
        table = _normal_table(ROUTER_STD if tensor.init == "router" else WEIGHT_STD)
        rng, bits = _generator(seed, tensor.name), np.empty(n, dtype=np.uint16)
        for start in range(0, n, DRAW_CHUNK):  # chunks of whole 8-byte words draw the same stream as one call
            stop = min(n, start + DRAW_CHUNK)
            np.take(table, np.frombuffer(rng.bytes(2 * (stop - start)), dtype=np.uint16), out=bits[start:stop])
    return bits.reshape(tensor.shape)


def expert_f32(seed: int, shape: SyntheticShape, layer: int, expert: int) -> tuple[np.ndarray, ...]:
    """gate [I,H], up [I,H], down [H,I] of one expert as float32, exactly what a reader of the
    bf16 folder gets."""
    return tuple(to_f32(values(seed, t)) for t in expert_tensors(shape, layer, expert))


# --- writers -------------------------------------------------------------------------------------


Progress = Callable[[int, int, str], None]


def write_hf_folder(shape: SyntheticShape, seed: int, out: Path, shard_bytes: int = 4 << 30,
                    progress: Progress | None = None) -> int:
    """config.json, generation_config.json and bf16 safetensors (one file, or shards with an
    index as `save_pretrained` writes them); returns the bytes of tensor data."""
    tensors = all_tensors(shape)
    shards: list[list[Planned]] = [[]]
    size = 0
    for t in tensors:
        if shards[-1] and size + t.nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += t.nbytes
    names = [SINGLE_FILE] if len(shards) == 1 else [
        f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    total, done = 0, 0
    for name, shard in zip(names, shards):
        def arrays(shard=shard) -> Iterator[np.ndarray]:
            nonlocal done
            for t in shard:
                yield values(seed, t)
                done += 1
                if progress and done % 256 == 0:
                    progress(done, len(tensors), t.name)
        total += write_file(out / name, [TensorSpec(t.name, "BF16", t.shape) for t in shard], arrays(), {"format": "pt"})
    if len(shards) > 1:
        index = {"metadata": {"total_size": total},
                 "weight_map": {t.name: name for name, shard in zip(names, shards) for t in shard}}
        (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG, indent=2) + "\n")
    (out / "config.json").write_text(json.dumps(config_json(shape), indent=2) + "\n")
    return total


def write_container(shape: SyntheticShape, seed: int, out: Path, bits: int = 4, dense_bits: int = 0,
                    progress: Progress | None = None):
    """A tierlab container of the same weights, written directly: experts through
    `ExpertBlobWriter`, dense.safetensors under convert's rule (`dense_entries`), then the
    manifest; equal blob for blob to `convert` of the folder `write_hf_folder` writes."""
    from tierlab.engine.container import ExpertBlobWriter, new_container_info, write_manifest
    from tierlab.engine.quant import build_blob_fast

    if bits not in (4, 8):
        raise ModelError(f"--bits must be 4 or 8, got {bits}")
    if dense_bits not in (0, 4, 8):
        raise ModelError(f"--dense-bits must be 0, 4 or 8, got {dense_bits}")
    info = new_container_info(bits, shape.layers, shape.experts, shape.hidden, shape.moe_inter,
                              f"make-synthetic seed {seed}", PREFIX, dense_bits)
    with ExpertBlobWriter(out, info) as blobs:
        for layer in range(shape.layers):
            for expert in range(shape.experts):
                blobs.add(layer, expert, build_blob_fast(*expert_f32(seed, shape, layer, expert), bits))
            if progress:
                progress(layer + 1, shape.layers + 1, f"layer {layer + 1}/{shape.layers}")
    write_container_dense(shape, seed, out, dense_bits)
    if progress:
        progress(shape.layers + 1, shape.layers + 1, "dense tensors")
    return write_manifest(out, blobs.info)  # the info as the writer finished it


def write_container_dense(shape: SyntheticShape, seed: int, out: Path, dense_bits: int = 0) -> int:
    """A container's dense.safetensors (and config files) for these weights; returns its data bytes.
    Containers of one seed differing only in --dense-bits share experts.bin."""
    from tierlab.engine.container import DENSE_FILE, DENSE_WRITER_METADATA, dense_entries, dense_part

    dense = dense_tensors(shape)
    by_name = {t.name: t for t in dense}
    plan = [e for t in dense for e in dense_entries(t.name, "BF16", t.shape, dense_bits, t.name)]
    memo: dict = {}

    def arrays() -> Iterator[np.ndarray]:
        for entry in plan:
            cached = entry.part != "copy" and memo.get("source") == entry.source
            yield dense_part(entry, None if cached else values(seed, by_name[entry.source]), dense_bits, memo)

    size = write_file(out / DENSE_FILE, [e.spec for e in plan], arrays(),
                      {**DENSE_WRITER_METADATA, "dense_bits": str(dense_bits)})
    (out / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG, indent=2) + "\n")
    (out / "config.json").write_text(json.dumps(config_json(shape), indent=2) + "\n")
    return size
