"""Tiny random checkpoints built by transformers itself: the numerical oracle.

Norm weights, A_log and dt_bias are randomised so that a wrong formula
(plain vs zero-centred norm, a missing gate) cannot hide behind the
initialiser's ones and zeros.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

torch = None


def _torch():
    global torch
    if torch is None:
        import torch as _t

        torch = _t
    return torch


def qwen3_5_config(n_experts=8, top_k=2, layers=4, hidden=64, vocab=256, shared=32):
    from transformers import Qwen3_5MoeTextConfig

    return Qwen3_5MoeTextConfig(
        vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
        moe_intermediate_size=32, shared_expert_intermediate_size=shared, num_experts=n_experts,
        num_experts_per_tok=top_k, full_attention_interval=2, max_position_embeddings=512,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        tie_word_embeddings=False, eos_token_id=1, bos_token_id=0,
    )


def qwen3_config(n_experts=8, top_k=2, layers=3, hidden=64, vocab=256, norm_topk=True):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=96, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, moe_intermediate_size=32,
        num_experts=n_experts, num_experts_per_tok=top_k, norm_topk_prob=norm_topk,
        max_position_embeddings=512, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        tie_word_embeddings=False, eos_token_id=1, bos_token_id=0,
    )


def build_model(config, seed: int = 0):
    t = _torch()
    from transformers import Qwen3_5MoeForCausalLM, Qwen3MoeForCausalLM

    t.manual_seed(seed)
    cls = Qwen3_5MoeForCausalLM if config.model_type.startswith("qwen3_5") else Qwen3MoeForCausalLM
    model = cls(config).to(t.float32).eval()
    with t.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.copy_(t.randn_like(p) * 0.2 + (0.0 if config.model_type.startswith("qwen3_5") else 1.0))
            elif name.endswith("A_log"):
                p.copy_(t.log(t.rand_like(p) * 8 + 0.5))
            elif name.endswith("dt_bias"):
                p.copy_(t.randn_like(p) * 0.5)
            elif "mlp.gate.weight" in name:
                p.copy_(t.randn_like(p) * 0.3)
            elif p.dim() >= 2:
                p.copy_(t.randn_like(p) * 0.08)
    return model


def save(model, folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def write_fused_vl(model, folder: Path) -> Path:
    """The official release's shape: fused experts under model.language_model., nested text_config."""
    from safetensors.numpy import save_file

    t = _torch()
    folder.mkdir(parents=True, exist_ok=True)
    cfg = model.config
    tensors = {}
    E = cfg.num_experts
    for name, p in model.state_dict().items():
        arr = p.detach().to(t.float32).numpy()
        if ".mlp.experts." in name:
            continue
        new = "lm_head.weight" if name == "lm_head.weight" else name.replace("model.", "model.language_model.", 1)
        tensors[new] = np.ascontiguousarray(arr)
    sd = model.state_dict()
    for i in range(cfg.num_hidden_layers):
        pre = f"model.layers.{i}.mlp.experts."
        if pre + "gate_up_proj" in sd:
            gate_up = sd[pre + "gate_up_proj"].numpy()
            down = sd[pre + "down_proj"].numpy()
        else:
            gate_up = np.stack([np.concatenate([sd[f"{pre}{e}.gate_proj.weight"].numpy(), sd[f"{pre}{e}.up_proj.weight"].numpy()])
                                for e in range(E)])
            down = np.stack([sd[f"{pre}{e}.down_proj.weight"].numpy() for e in range(E)])
        tensors[f"model.language_model.layers.{i}.mlp.experts.gate_up_proj"] = np.ascontiguousarray(gate_up)
        tensors[f"model.language_model.layers.{i}.mlp.experts.down_proj"] = np.ascontiguousarray(down)
    # split into two shards with an index, as real releases are
    names = sorted(tensors)
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    weight_map = {}
    for fname, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(folder / fname))
        weight_map.update({k: fname for k in keys})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    text = cfg.to_dict()
    text["model_type"] = "qwen3_5_moe_text"
    (folder / "config.json").write_text(json.dumps({
        "model_type": "qwen3_5_moe", "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "text_config": text, "vision_config": {"depth": 1}, "tie_word_embeddings": False,
    }))
    return folder


def hf_logits(model, ids) -> np.ndarray:
    t = _torch()
    with t.no_grad():
        out = model(t.tensor([list(ids)]))
    return out.logits[0].to(t.float32).numpy()


def hf_greedy(model, prompt, n) -> list[int]:
    """Greedy continuation computed by re-running the whole sequence (no cache subtleties)."""
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(np.argmax(hf_logits(model, ids)[-1])))
    return ids
