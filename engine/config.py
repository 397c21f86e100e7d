"""Reading a Hugging Face config.json into the few numbers the engine needs.

Real checkpoints disagree on where things live: the Qwen3.6 release is a
vision-language model with its text settings under `text_config`; configs
written by transformers 5 say `num_local_experts` where older ones say
`num_experts`; rope settings may sit at the top level or in
`rope_parameters`. This module hides all of that behind `ModelConfig`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from tierlab.engine.bounded_read import read_text
from tierlab.engine.errors import ModelError

QWEN3_MOE = "qwen3_moe"
QWEN3_5_MOE = "qwen3_5_moe"
SUPPORTED = {
    "qwen3_moe": QWEN3_MOE,
    "qwen3_5_moe": QWEN3_5_MOE,
    "qwen3_5_moe_text": QWEN3_5_MOE,
}


@dataclass
class ModelConfig:
    arch: str  # QWEN3_MOE or QWEN3_5_MOE
    model_type: str  # as written in config.json
    hidden_size: int
    n_layers: int
    vocab_size: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    n_experts: int
    top_k: int
    moe_inter: int
    shared_inter: int  # 0: no shared expert
    dense_inter: int  # intermediate size of dense-MLP layers (qwen3_moe mlp_only_layers)
    norm_topk_prob: bool
    rms_eps: float
    rope_theta: float
    rotary_dim: int
    tie_embeddings: bool
    layer_types: list[str]  # "full_attention" | "linear_attention" per layer
    moe_layers: list[bool]  # False: dense SwiGLU MLP (qwen3_moe mlp_only_layers)
    zero_centred_norm: bool  # Qwen3.5: y = x_hat * (1 + w); the checkpoint returns such norms as 1 + w
    attn_output_gate: bool  # Qwen3.5: q_proj carries a per-head sigmoid gate
    # Gated DeltaNet (Qwen3.5 linear_attention layers)
    lin_k_heads: int = 0
    lin_v_heads: int = 0
    lin_k_dim: int = 0
    lin_v_dim: int = 0
    conv_kernel: int = 4
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None
    is_vl: bool = False  # nested text_config: tensors under model.language_model.
    max_positions: int = 0  # max_position_embeddings: the longest sequence the model takes (0: not given)

    @property
    def is_hybrid(self) -> bool:
        return self.arch == QWEN3_5_MOE


#: the largest value each size may have: generous for any released MoE, and small enough that
#: nothing sized from it is allocated before the tensors are checked against it
DIM_CAPS = {
    "hidden_size": 1 << 16,
    "num_hidden_layers": 1 << 12,
    "vocab_size": 1 << 22,
    "num_attention_heads": 1 << 12,
    "num_key_value_heads": 1 << 12,
    "head_dim": 1 << 12,
    "num_experts": 1 << 16,
    "num_experts_per_tok": 1 << 10,
    "moe_intermediate_size": 1 << 18,
    "shared_expert_intermediate_size": 1 << 18,
    "intermediate_size": 1 << 18,
    "linear_num_key_heads": 1 << 12,
    "linear_num_value_heads": 1 << 12,
    "linear_key_head_dim": 1 << 12,
    "linear_value_head_dim": 1 << 12,
    "linear_conv_kernel_dim": 1 << 6,
    "max_position_embeddings": 1 << 26,
}
#: layers x experts is the size of every per-expert table (heat, residency, router state)
MAX_LAYER_EXPERTS = 1 << 22


def _get(cfg: dict, *names: str, default=None, required: bool = False, path: Path | None = None):
    for name in names:
        if name in cfg and cfg[name] is not None:
            return cfg[name]
    if required:
        raise ModelError(f"config.json lacks {' / '.join(names)}", path)
    return default


def _show(value) -> str:
    """A value as a message quotes it: short, whatever it is."""
    try:
        text = repr(value)
    except ValueError:  # an integer too long to print
        return "a very large number"
    return text if len(text) <= 60 else text[:57] + "..."


def _as_int(value, name: str, path: Path) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or (isinstance(value, float) and not math.isfinite(value)) \
            or int(value) != value or value < 0:
        raise ModelError(f"config.json: {name} must be a non-negative integer, got {_show(value)}", path)
    cap = DIM_CAPS.get(name)
    if cap is not None and value > cap:
        raise ModelError(f"config.json: {name}={_show(int(value))} is larger than any model this engine runs (at most {cap})",
                         path)
    return int(value)


def _as_float(value, name: str, path: Path, positive: bool = True) -> float:
    """A finite number (positive where the engine divides or scales by it)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value \
            or value in (float("inf"), float("-inf")) or (positive and value <= 0):
        kind = "a finite positive number" if positive else "a finite number"
        raise ModelError(f"config.json: {name} must be {kind}, got {_show(value)}", path)
    return float(value)


def _as_bool(value, name: str, path: Path) -> bool:
    if not isinstance(value, bool):
        raise ModelError(f"config.json: {name} must be true or false, got {_show(value)}", path)
    return value


def _token_ids(value, name: str, path: Path) -> list[int]:
    """`eos_token_id`: one id or a list of ids."""
    values = value if isinstance(value, list) else [value]
    return [_as_int(v, name, path) for v in values]


def load_config(model_dir: str | Path) -> ModelConfig:
    """Parse `model_dir/config.json`; raises ModelError with one line on anything wrong."""
    path = Path(model_dir) / "config.json"
    if not path.exists() and not path.is_symlink():
        raise ModelError("no config.json (is this a model folder?)", path)
    text = read_text(path, "config.json", ModelError)
    try:
        raw = json.loads(text)
    except RecursionError:
        raise ModelError("config.json is nested too deeply", path) from None
    except json.JSONDecodeError as exc:
        raise ModelError(f"cannot read config.json: {exc}", path) from None
    if not isinstance(raw, dict):
        raise ModelError("config.json is not a JSON object", path)
    return parse_config(raw, path)


def parse_config(raw: dict, path: Path) -> ModelConfig:
    top_type = raw.get("model_type")
    cfg = raw
    is_vl = False
    if isinstance(raw.get("text_config"), dict):
        cfg = dict(raw["text_config"])
        is_vl = True
        for key in ("tie_word_embeddings", "eos_token_id", "bos_token_id"):
            cfg.setdefault(key, raw.get(key))
    model_type = cfg.get("model_type") or top_type
    if not isinstance(model_type, str) or model_type not in SUPPORTED:
        model_type = top_type
    if not isinstance(model_type, str) or model_type not in SUPPORTED:
        raise ModelError(
            f"unknown model_type {_show(model_type)} (supported: {', '.join(sorted(SUPPORTED))})", path
        )
    arch = SUPPORTED[model_type]

    def need(*names: str) -> int:
        return _as_int(_get(cfg, *names, required=True, path=path), names[0], path)

    hidden = need("hidden_size")
    n_layers = need("num_hidden_layers")
    n_heads = need("num_attention_heads")
    n_kv = _as_int(_get(cfg, "num_key_value_heads", default=n_heads), "num_key_value_heads", path)
    head_dim = _as_int(_get(cfg, "head_dim", default=hidden // max(n_heads, 1)), "head_dim", path)
    n_experts = need("num_experts", "num_local_experts")
    top_k = need("num_experts_per_tok")
    if n_experts < 1 or not 1 <= top_k <= n_experts:
        raise ModelError(f"config.json: num_experts_per_tok={top_k} does not fit num_experts={n_experts}", path)
    if n_layers * n_experts > MAX_LAYER_EXPERTS:
        raise ModelError(f"config.json: {n_layers} layers x {n_experts} experts is more than the "
                         f"{MAX_LAYER_EXPERTS} expert tables this engine holds", path)
    if n_heads % max(n_kv, 1):
        raise ModelError(f"config.json: {n_heads} heads not divisible by {n_kv} KV heads", path)
    if _get(cfg, "attention_bias", default=False):
        raise ModelError("config.json: attention_bias=true is not supported", path)

    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        rope = {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", None, "mrope"):
        raise ModelError(f"config.json: rope_type {_show(rope_type)} is not supported", path)
    rope_theta = _as_float(_get(cfg, "rope_theta", default=rope.get("rope_theta", 10000.0)), "rope_theta", path)
    partial = _as_float(_get(cfg, "partial_rotary_factor", default=rope.get("partial_rotary_factor", 1.0)),
                        "partial_rotary_factor", path)
    if partial > 1:
        raise ModelError(f"config.json: partial_rotary_factor must be at most 1, got {partial!r}", path)
    rotary_dim = int(head_dim * partial)
    rotary_dim -= rotary_dim % 2

    if arch == QWEN3_5_MOE:
        layer_types = cfg.get("layer_types")
        if layer_types is None:
            interval = _as_int(_get(cfg, "full_attention_interval", default=4), "full_attention_interval", path)
            layer_types = [
                "full_attention" if (i + 1) % max(interval, 1) == 0 else "linear_attention" for i in range(n_layers)
            ]
        moe_layers = [True] * n_layers
        shared = _as_int(_get(cfg, "shared_expert_intermediate_size", default=0), "shared_expert_intermediate_size", path)
        norm_topk = True
    else:
        layer_types = ["full_attention"] * n_layers
        step = _as_int(_get(cfg, "decoder_sparse_step", default=1), "decoder_sparse_step", path) or 1
        mlp_only_raw = cfg.get("mlp_only_layers") or []
        if not isinstance(mlp_only_raw, list):
            raise ModelError(f"config.json: mlp_only_layers must be a list of layer numbers, got {_show(mlp_only_raw)}", path)
        mlp_only = {_as_int(i, "mlp_only_layers", path) for i in mlp_only_raw}
        moe_layers = [(i not in mlp_only) and (i + 1) % step == 0 for i in range(n_layers)]
        shared = 0
        norm_topk = _as_bool(_get(cfg, "norm_topk_prob", default=False), "norm_topk_prob", path)
    if not isinstance(layer_types, list) or len(layer_types) != n_layers or any(t not in ("full_attention", "linear_attention") for t in layer_types):
        raise ModelError("config.json: layer_types must list full_attention/linear_attention for every layer", path)

    eos_ids = _token_ids(_get(cfg, "eos_token_id", default=[]), "eos_token_id", path)
    bos = _get(cfg, "bos_token_id", default=None)
    bos_id = None if bos is None else _as_int(bos, "bos_token_id", path)
    return ModelConfig(
        arch=arch,
        model_type=str(model_type),
        hidden_size=hidden,
        n_layers=n_layers,
        vocab_size=need("vocab_size"),
        n_heads=n_heads,
        n_kv_heads=n_kv,
        head_dim=head_dim,
        n_experts=n_experts,
        top_k=top_k,
        moe_inter=need("moe_intermediate_size"),
        shared_inter=shared,
        dense_inter=_as_int(_get(cfg, "intermediate_size", default=0), "intermediate_size", path),
        norm_topk_prob=norm_topk,
        rms_eps=_as_float(_get(cfg, "rms_norm_eps", default=1e-6), "rms_norm_eps", path),
        rope_theta=rope_theta,
        rotary_dim=rotary_dim,
        tie_embeddings=_as_bool(_get(cfg, "tie_word_embeddings", default=False), "tie_word_embeddings", path),
        layer_types=list(layer_types),
        moe_layers=moe_layers,
        zero_centred_norm=arch == QWEN3_5_MOE,
        attn_output_gate=arch == QWEN3_5_MOE,
        lin_k_heads=_as_int(_get(cfg, "linear_num_key_heads", default=0), "linear_num_key_heads", path),
        lin_v_heads=_as_int(_get(cfg, "linear_num_value_heads", default=0), "linear_num_value_heads", path),
        lin_k_dim=_as_int(_get(cfg, "linear_key_head_dim", default=0), "linear_key_head_dim", path),
        lin_v_dim=_as_int(_get(cfg, "linear_value_head_dim", default=0), "linear_value_head_dim", path),
        conv_kernel=_as_int(_get(cfg, "linear_conv_kernel_dim", default=4), "linear_conv_kernel_dim", path),
        eos_token_ids=eos_ids,
        bos_token_id=bos_id,
        is_vl=is_vl,
        max_positions=_as_int(_get(cfg, "max_position_embeddings", default=0), "max_position_embeddings", path),
    )
